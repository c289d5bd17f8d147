"""Where flash's clipped gradients go when there are several ranks: asynchronous buckets of
torch.distributed collectives (an all-reduce under DDP, a reduce-scatter into FSDP2's shards,
or, DDP with one sample per rank, all-gathers of per-sample gradients during the backward).

Gradients are SUMMED over ranks everywhere: every trainer scales its loss (or clip factors) by
1/B of the global batch, so the sum over ranks is the single-process mean over that batch.
"""

from __future__ import annotations

import collections

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp._fully_shard._fsdp_common import _from_local_no_grad
from torch.distributed.tensor import DTensor

from dp_cost.flash.precision import cast, wider

BUCKET_BYTES = 25 * 2**20  # FSDP2's reduce-scatters and the gathers: DDP's default bucket size
# DDP's all-reduces of the clipped sums run after the backward, beside the clipped GEMMs alone,
# and are what the step waits for at its end: fewer, larger collectives finish sooner there
# (measured against 25 and 400 MB: benchmarks/fsdp_buckets.py sets both sizes).
ALL_REDUCE_BUCKET_BYTES = 100 * 2**20
# A step's last collectives land in this many groups of about equal bytes, each group's noise
# and optimizer step run while the later groups' collectives are still on the wire (one group:
# every collective waited for first, then the noise and the step alone; the compute stream was
# idle behind about the last 5 ms of the 1b model's all-reduces on 2 H200s).
LANDING_GROUPS = 4


def _own_storage(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``, or a copy where it is a view of a larger buffer (the small parameters' sums
    come as views of one): a gradient kept in its own storage, as autograd gives it."""
    return tensor if tensor.untyped_storage().nbytes() == tensor.nbytes else tensor.clone()


class GradientBuckets:
    """flash's clipped sums (or, gathered, its per-sample gradients) handed over one parameter
    at a time and sent asynchronously, so each collective runs while the next layers' are
    computed. A gradient of at least a quarter of the bucket size (``bucket_limit``) is sent
    alone as soon as it arrives (no copy); smaller ones (biases, norm weights, LoRA's hundreds of
    tensors) fill a bucket of about that size of one dtype, one collective when full. The
    collectives behind the newest are waited for once what they read passes IN_FLIGHT_BYTES, so
    the memory they hold stays bounded.

    Every rank must issue the same collectives in the same order: every managed parameter is
    handed over in one fixed order (zeros for a layer a chunk did not reach), cast to a dtype
    fixed by the parameter, so every rank forms the same buckets."""

    # What the collectives behind the newest may read, in bytes (None: no bound; 0: each waited
    # for at once). A bucket of small tensors also holds its sources until then. One at a time
    # kept the compute stream waiting on each (1b, FSDP2, (2, 4096) on 2 H100s: flash 1.2x
    # standard's step); no bound gave 1.02x at the same peak, but lets a whole model's unsharded
    # gradients wait (an 8B model's: 30 GB per rank). 256 MB: about one 1b block in fp32.
    IN_FLIGHT_BYTES: int | None = 256 * 2**20

    def __init__(self, lands_at_finish: bool = True):
        self.bucket: list[tuple] = []  # (what _land fills, the tensor sent)
        self.bucket_bytes = 0
        self.pending: collections.deque = collections.deque()
        self.pending_bytes = 0
        # False: finish sends the last bucket and leaves its collectives pending for
        # landed_groups (a step's last sink, whose caller updates parameters as they land)
        self.lands_at_finish = lands_at_finish

    def _add(self, param, grad: torch.Tensor) -> None:
        size = grad.numel() * grad.element_size()
        limit = self.bucket_limit()
        if 4 * size >= limit:
            self._launch([(param, grad)])
            return
        if self.bucket and (
            self.bucket_bytes + size > limit or self.bucket[0][1].dtype != grad.dtype
        ):
            self._launch(self._take_bucket())
        self.bucket.append((param, grad))
        self.bucket_bytes += size
        if self.bucket_bytes >= limit:
            self._launch(self._take_bucket())

    def bucket_limit(self) -> int:
        return BUCKET_BYTES

    def _take_bucket(self) -> list:
        bucket, self.bucket, self.bucket_bytes = self.bucket, [], 0
        return bucket

    def _launch(self, bucket: list, bounded: bool = True) -> None:
        # What the collective reads stays referenced until it is waited for: the compute
        # stream does not reuse that memory while NCCL may still read it.
        self.pending.append((bucket, *self._send(bucket)))
        newest = self.pending[-1][2].nbytes
        self.pending_bytes += newest
        limit = self.IN_FLIGHT_BYTES
        if limit is None or not bounded:
            return
        while self.pending and (
            limit == 0 or (len(self.pending) > 1 and self.pending_bytes - newest > limit)
        ):
            self._land_oldest()

    def _land_oldest(self) -> None:
        bucket, work, sent, received = self.pending.popleft()
        self.pending_bytes -= sent.nbytes
        self._land(bucket, work, sent, received)

    def _send_open_bucket(self, bounded: bool = True) -> None:
        if self.bucket:
            self._launch(self._take_bucket(), bounded)

    def _drain(self) -> None:
        """Send the open bucket, then land every collective (unless ``lands_at_finish`` is
        False: the caller lands them, by landed_groups or land_pending, and the last bucket
        goes without the in-flight bound: a small bucket sent after a large gradient (Llama's
        embedding) would make the compute stream wait for that gradient here, where the caller
        means to overlap it with its own work)."""
        self._send_open_bucket(bounded=self.lands_at_finish)
        if self.lands_at_finish:
            self.land_pending()

    def land_pending(self) -> None:
        """Every collective it left pending at its finish, landed (oldest first)."""
        while self.pending:
            self._land_oldest()

    def pending_parameters(self) -> set[int]:
        """ids of the parameters whose collectives have not landed (the open bucket's too)."""
        buckets = [self.bucket, *(entry[0] for entry in self.pending)]
        return {id(param) for bucket in buckets for param, _ in bucket}

    def landed_groups(self, count: int):
        """Every pending collective landed, oldest first, in ``count`` groups of about equal
        bytes; after each group, the parameters whose gradients it landed, so the caller's work
        on them runs while the later groups' collectives go on. The groups are the same on
        every rank (the buckets are). What a bucket sent is let go before its group is handed
        out (an unsharded sum sent alone is the tensor sent)."""
        self._send_open_bucket()
        share, landed, group = self.pending_bytes / max(count, 1), 0, []
        bound = share
        while self.pending:
            landed += self.pending[0][2].nbytes
            group += [param for param, _ in self.pending[0][0]]
            self._land_oldest()
            if landed >= bound or not self.pending:
                yield group
                group, bound = [], max(bound + share, landed)

    def _send(self, bucket: list) -> tuple:
        """Start the bucket's collective: (work, what it reads, what it writes)."""
        raise NotImplementedError

    def _land(self, bucket: list, work, sent: torch.Tensor, received: torch.Tensor) -> None:
        """The collective is done (the compute stream waits for it; the host does not)."""
        raise NotImplementedError


class SummedGradients(GradientBuckets):
    """flash's sink under DDP, in a step's last chunk: each parameter's clipped sum is added to
    its .grad, and the finished gradients are summed over the ranks in buckets (the step's noise
    is added after the sum, alike on every replica: the trainer's optimizer step), in buckets of
    ALL_REDUCE_BUCKET_BYTES. Every collective may be pending until finish, or past it until the
    optimizer step lands them (the gradients exist anyway; only the buckets of several
    gradients are copies), so the compute stream never waits for one before the last clipped
    sum."""

    IN_FLIGHT_BYTES = None

    def __init__(self, lands_at_finish: bool = True):
        super().__init__(lands_at_finish)
        self.handed: set[int] = set()

    def bucket_limit(self) -> int:
        return ALL_REDUCE_BUCKET_BYTES

    def __call__(self, param: nn.Parameter, full: torch.Tensor) -> None:
        full = cast(full, param.dtype)
        if full.shape != param.shape:  # a no-op view is an operator dispatch too
            full = full.view(param.shape)
        if param.grad is None:
            param.grad = _own_storage(full)
        else:
            param.grad.add_(full)
        self.handed.add(id(param))
        self._add(param, param.grad)

    def _send(self, bucket):
        grads = [grad for _, grad in bucket]
        flat = grads[0] if len(grads) == 1 else torch.cat([g.reshape(-1) for g in grads])
        return dist.all_reduce(flat, async_op=True), flat, flat

    def _land(self, bucket, work, sent, received):
        work.wait()
        if len(bucket) > 1:
            grads = [grad for _, grad in bucket]
            pieces = received.split([g.numel() for g in grads])
            torch._foreach_copy_(grads, [p.view_as(g) for p, g in zip(pieces, grads)])

    def finish(self, params: list[nn.Parameter]) -> None:
        """Sum the parameters not handed over (every one for an empty batch: zero gradients),
        in ``params``' order, then wait for every collective (or, not ``lands_at_finish``, leave
        them to landed_groups)."""
        for param in params:
            if id(param) not in self.handed:
                if param.grad is None:
                    param.grad = torch.zeros_like(param)
                self._add(param, param.grad)
        self._drain()


class ShardedGradients(GradientBuckets):
    """flash's sink under FSDP2: each parameter's full clipped sum is reduce-scattered over the
    ranks straight into that parameter's shard (.grad, a DTensor like the parameter), then
    dropped: the unsharded gradients held are those in flight (the newest, and up to
    IN_FLIGHT_BYTES behind it), the small ones' bucket and the one being computed.

    FSDP2 shards dimension 0 as torch.chunk does (ceil(n / W) rows per rank, the last ranks
    shorter or empty); each gradient is padded to W equal pieces to match, and a bucket's input
    is rank-major (every parameter's piece for rank 0, then for rank 1, ...), as FSDP2 lays out
    its own reduce-scatter."""

    def __init__(self, held: dict | None = None, lands_at_finish: bool = True):
        super().__init__(lands_at_finish)
        self.world_size = dist.get_world_size()
        self.held = held  # HeldSums' of the chunks before this (the last), added in and dropped

    def __call__(self, param: nn.Parameter, full: torch.Tensor) -> None:
        if not isinstance(param, DTensor):  # a parameter FSDP left unsharded (none today)
            raise TypeError(f"expected an FSDP2-sharded parameter, got {type(param).__name__}")
        # Summed in fp32 at least (a 16-bit parameter's too), a dtype the parameter fixes.
        full = cast(full, wider(param.dtype, torch.float32))
        if self.held and id(param) in self.held:
            full = full + self.held.pop(id(param))[1]
        padding = -full.shape[0] % self.world_size
        if padding:
            full = torch.cat([full, full.new_zeros((padding, *full.shape[1:]))])
        self._add(param, full)

    def _send(self, bucket):
        # [W, piece] per gradient (a view: dimension 0 split in W), side by side, flattened; a
        # gradient sent alone is that layout already, flattened (no op beyond the view).
        if len(bucket) == 1:
            full = bucket[0][1]
            sent = full.view(-1) if full.is_contiguous() else full.reshape(-1)
        else:
            columns = [full.reshape(self.world_size, -1) for _, full in bucket]
            sent = torch.cat(columns, dim=1).view(-1)
        received = sent.new_empty(sent.numel() // self.world_size)
        return dist.reduce_scatter_tensor(received, sent, async_op=True), sent, received

    def _land(self, bucket, work, sent, received):
        work.wait()
        if len(bucket) == 1:
            pieces = (received,)
        else:
            pieces = received.split([full.numel() // self.world_size for _, full in bucket])
        with torch.no_grad():  # to_local is then the local tensor, not an autograd Function
            for (param, full), piece in zip(bucket, pieces, strict=True):
                rows = param.to_local().shape[0]
                local = piece.view(-1, *full.shape[1:])
                if local.shape[0] != rows:  # the padding of the last ranks' pieces
                    local = local[:rows]
                local = cast(local, param.dtype)
                if param.grad is None:  # FSDP2's own constructor for its gradients: no autograd
                    param.grad = _from_local_no_grad(local, param._spec)  # (from_local's ~10x)
                else:
                    param.grad.to_local().add_(local)

    def finish(self, params: list[nn.Parameter]) -> None:
        """Send the last bucket and wait for every collective, or leave them to landed_groups
        (``params``: as SummedGradients.finish; an empty batch hands none over, and
        optimizer_step gives each shard its zeros and noise). Sums still held (none: every
        chunk hands every parameter over) are sent first, in ``params``' order, the same on
        every rank."""
        for param in params:
            if self.held and id(param) in self.held:
                self(param, torch.zeros_like(self.held[id(param)][1]))
        self._drain()


class HeldSums:
    """flash's sink under FSDP2 with fsdp_sync "logical", in the chunks of a logical batch
    before its last: each parameter's full clipped sum is added to the unsharded sum held for
    it in ``held`` (id -> (parameter, sum)), with no collective; the last chunk's
    ShardedGradients adds them in and reduce-scatters once. So every managed parameter's
    unsharded gradient is held, in fp32 at least, from the first chunk to the last (FSDP2 holds
    standard's alike)."""

    def __init__(self, held: dict):
        self.held = held

    def __call__(self, param: nn.Parameter, full: torch.Tensor) -> None:
        full = cast(full, wider(param.dtype, torch.float32))
        if id(param) in self.held:
            self.held[id(param)][1].add_(full)
        else:
            self.held[id(param)] = (param, _own_storage(full))

    def finish(self, params: list[nn.Parameter]) -> None:
        """Nothing to send before the last chunk."""


# Gathered per-sample gradients of more elements than this travel in a 16-bit step's dtype.
SMALL_GRADIENT_NUMEL = 2**18


class GatheredGradients(GradientBuckets):
    """DP-SGD under DDP with one sample per rank. The clipped sum c_0 g_0 + c_1 g_1 needs both
    clip factors, so its all-reduce cannot start before the backward ends, and one sample leaves
    no clipped GEMM to overlap it with: the whole gradient's all-reduce would follow the backward.
    Instead each rank's gradient, which is its one sample's per-sample gradient, is all-gathered
    while the backward goes on, each parameter's as soon as autograd has accumulated it. At two
    ranks an all-gather moves the bytes an all-reduce does ((W - 1) * S per rank against
    2 (W - 1) / W * S); beyond two, W / 2 times more, and every rank holds W samples' gradients:
    two ranks only. Every rank then holds the global batch's per-sample gradients, sample k
    from rank k: its norms (each sample's own, never mixed), clip factors and clipped sum are
    the single process's, computed alike on every rank; the noise is drawn from a generator the
    ranks seeded alike (seeded_generator), so every replica adds the same draw: once per
    coordinate.
    Gradients are handed to the buckets in one fixed order, the parameters last registered
    first, each once autograd has accumulated it and every one before it is handed over. That is
    about the order the backward reaches them; where a block registers its norms after its other
    layers (Hugging Face's Llama), the block's go once its first norm's is in. A parameter the
    backward never reached is handed over as zeros at the end (the ones after it wait until
    then). Large gradients are gathered alone, small ones in buckets (GradientBuckets). Every
    rank so issues the same collectives in the same order, whatever its data. Nothing
    re-synchronises the replicas afterwards: they stay equal because what follows the gathers
    is deterministic (row norms, weighted sums, the noise kernel: no atomics)."""

    IN_FLIGHT_BYTES = None  # the backward never waits for a gather: every one lands at the end

    def __init__(self, params: list[nn.Parameter], step_dtype: torch.dtype):
        super().__init__()
        self.world_size, self.step_dtype = dist.get_world_size(), step_dtype
        self.params = params
        self.order = list(reversed(params))
        self.launched = 0  # self.order[:launched] are handed to the buckets
        self.accumulated: set[int] = set()
        self.gathered: dict[int, torch.Tensor] = {}
        self.handles = [p.register_post_accumulate_grad_hook(self.gradient_ready) for p in params]

    def __enter__(self) -> GatheredGradients:
        return self

    def __exit__(self, *exc) -> None:  # also when the step fails: else the next step's fire
        self.remove_hooks()

    def remove_hooks(self) -> None:
        """The post-accumulate hooks go with the step (removing twice is harmless)."""
        for handle in self.handles:
            handle.remove()

    def tensors(self) -> list[torch.Tensor]:
        """What it holds: the gradients handed over, sent, received or landed (memory census)."""
        held = [t for entry in self.pending for t in entry[2:]] + list(self.gathered.values())
        return held + [local for _, local in self.bucket]

    def gradient_ready(self, param: nn.Parameter) -> None:
        """autograd accumulated ``param``'s gradient: hand over what the order allows."""
        self.accumulated.add(id(param))
        while self.launched < len(self.order) and id(self.order[self.launched]) in self.accumulated:
            self.start_gather(self.order[self.launched])

    def start_gather(self, param: nn.Parameter) -> None:
        grad = param.grad if param.grad is not None else torch.zeros_like(param)
        grad = grad.to_dense() if grad.is_sparse else grad  # Embedding(sparse=True)'s
        param.grad = None  # what is sent replaces it (the fp32 .grad of a 16-bit step goes)
        self._add(param, grad[None].to(self.wire_dtype(param, self.step_dtype)))
        self.launched += 1

    @staticmethod
    def wire_dtype(param: nn.Parameter, step_dtype: torch.dtype) -> torch.dtype:
        """The dtype a parameter's gradient is gathered in, fixed by the parameter and the step
        (so every rank's pieces match, zeros included). A 16-bit step sends large ones in its
        dtype (the Linear weights' gradients come from its GEMMs; an embedding table's is
        rounded to it), and the bytes are half: on 2 H100s at 1b bf16 (2, 4096), a step of 126
        ms against 172 ms in fp32, measured when the engine's hooks formed these gradients.
        Small ones (biases, norm layers) go in fp32 or wider."""
        if step_dtype.itemsize < 4 and param.numel() > SMALL_GRADIENT_NUMEL:
            return step_dtype
        return wider(param.dtype, torch.float32)

    def _send(self, bucket):
        # [1, numel] per gradient, side by side: one all-gather stacks the ranks' rows.
        rows = [local.reshape(1, -1) for _, local in bucket]
        sent = rows[0] if len(rows) == 1 else torch.cat(rows, dim=1)
        received = sent.new_empty((self.world_size, sent.shape[1]))
        return dist.all_gather_into_tensor(received, sent, async_op=True), sent, received

    def _land(self, bucket, work, sent, received):
        work.wait()
        pieces = received.split([param.numel() for param, _ in bucket], dim=1)
        for (param, _), piece in zip(bucket, pieces, strict=True):
            piece = piece if len(bucket) == 1 else piece.contiguous()
            self.gathered[id(param)] = piece.view(self.world_size, *param.shape)

    def land(self) -> list[torch.Tensor]:
        """After the backward: hand over what is left, wait for every gather (the compute stream
        waits; the host does not); each parameter's per-sample gradients [W, ...], sample k from
        rank k, in the order of ``params``."""
        self.remove_hooks()
        while self.launched < len(self.order):
            self.start_gather(self.order[self.launched])
        self._drain()
        return [self.gathered.pop(id(param)) for param in self.params]


def local_gradients(params: list[nn.Parameter]) -> list[torch.Tensor]:
    """The tensors a rank holds of each parameter's .grad (a DTensor's local shard, itself: out
    of grad mode to_local returns it, where in grad mode it is an autograd Function's output, a
    score of Python calls a parameter)."""
    with torch.no_grad():
        return [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in params]

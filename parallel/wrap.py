"""How a trainer's model and gradients are spread over the ranks: torch's DDP and FSDP2, and
the collectives flash's clipped gradients take (torch.distributed's, no other communication).

Gradients are SUMMED over ranks everywhere: every trainer scales its loss (or clip factors) by
1/B of the global batch, so the sum over ranks is the single-process mean over that batch.
"""

from __future__ import annotations

import collections
import contextlib
import datetime
from collections.abc import Callable

import torch
import torch.distributed as dist
from opacus.utils.fsdp_utils import FSDP2Wrapper
from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_common import _from_local_no_grad
from torch.distributed.tensor import DTensor

from parallel.ranks import RankInfo

# A collective that waits this long is a failure (a rank died or ran out of memory): recorded as
# an error for the config rather than a hang. The CLI stops the other ranks' workers much sooner
# when one rank's worker ends badly; this is the backstop.
GROUP_TIMEOUT = datetime.timedelta(minutes=10)
BUCKET_BYTES = 25 * 2**20  # DDP's default bucket size


def init_worker_group(info: RankInfo, prefix: str, device: torch.device) -> None:
    """The default process group of one config's workers (one per rank), on the job's store
    under ``prefix``: each config gets a fresh group, as each gets fresh processes."""
    store = dist.TCPStore(
        info.master_addr, info.master_port, is_master=False, timeout=GROUP_TIMEOUT
    )
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        store=dist.PrefixStore(prefix, store),
        rank=info.rank,
        world_size=info.world_size,
        timeout=GROUP_TIMEOUT,
        device_id=device if device.type == "cuda" else None,
    )


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks (the members of the outermost nn.ModuleLists): FSDP's units."""
    blocks: list[nn.Module] = []
    inside: set[int] = set()
    for module in model.modules():
        if id(module) in inside or not isinstance(module, nn.ModuleList):
            continue
        for block in module:
            blocks.append(block)
            inside.update(id(m) for m in block.modules())
    return blocks


def shard(model: nn.Module, units: str) -> nn.Module:
    """FSDP2 over ``model`` in place, in FSDP_UNITS[units]."""
    return FSDP_UNITS[units](model)


def shard_blocks(model: nn.Module) -> nn.Module:
    """Each transformer block one FSDP2 unit (all-gathered for its forward and backward, then
    resharded), the rest in the root unit; gradients summed over ranks (FSDP2 averages by
    default; the trainers' 1/B is already the global batch's)."""
    for block in transformer_blocks(model):
        fully_shard(block)
    fully_shard(model)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            # A plain SUM (NCCL would otherwise use PreMulSum by 1.0, which gloo lacks).
            module.set_force_sum_reduction_for_comms(True)
    return model


FSDP_UNITS = {
    "blocks": shard_blocks,
    # Opacus' FSDP2 path (ghost clipping): every layer it has a norm sampler for is its own
    # unit (its hooks need that layer's parameters whole); gradients averaged over ranks, as
    # Opacus' FSDP optimizer expects.
    "opacus_layers": FSDP2Wrapper,
}


def broadcast_parameters(model: nn.Module) -> None:
    """Every rank starts from rank 0's parameters (as DDP does on wrapping)."""
    with torch.no_grad():
        for param in model.parameters():
            dist.broadcast(param.data, 0)


class GradientBuckets:
    """flash's clipped sums (or, gathered, its per-sample gradients) handed over one parameter
    at a time and sent asynchronously, so each collective runs while the next layers' are
    computed. A gradient of at least a quarter of BUCKET_BYTES is sent alone as soon as it
    arrives (no copy); smaller ones (biases, norm weights, LoRA's hundreds of tensors) fill a
    bucket of about BUCKET_BYTES of one dtype, one collective when full. The collectives behind
    the newest are waited for once what they read passes IN_FLIGHT_BYTES, so the memory they
    hold stays bounded.

    Every rank must issue the same collectives in the same order: every managed parameter is
    handed over in one fixed order (zeros for a layer a chunk did not reach), cast to a dtype
    fixed by the parameter, so every rank forms the same buckets."""

    # What the collectives behind the newest may read, in bytes (None: no bound; 0: each waited
    # for at once). A bucket of small tensors also holds its sources until then. One at a time
    # kept the compute stream waiting on each (1b, FSDP2, (2, 4096) on 2 H100s: flash 1.2x
    # standard's step); no bound gave 1.02x at the same peak, but lets a whole model's unsharded
    # gradients wait (an 8B model's: 30 GB per rank). 256 MB: about one 1b block in fp32.
    IN_FLIGHT_BYTES: int | None = 256 * 2**20

    def __init__(self):
        self.bucket: list[tuple] = []  # (what _land fills, the tensor sent)
        self.bucket_bytes = 0
        self.pending: collections.deque = collections.deque()
        self.pending_bytes = 0

    def _add(self, param, grad: torch.Tensor) -> None:
        size = grad.numel() * grad.element_size()
        if 4 * size >= BUCKET_BYTES:
            self._launch([(param, grad)])
            return
        if self.bucket and (
            self.bucket_bytes + size > BUCKET_BYTES or self.bucket[0][1].dtype != grad.dtype
        ):
            self._launch(self._take_bucket())
        self.bucket.append((param, grad))
        self.bucket_bytes += size
        if self.bucket_bytes >= BUCKET_BYTES:
            self._launch(self._take_bucket())

    def _take_bucket(self) -> list:
        bucket, self.bucket, self.bucket_bytes = self.bucket, [], 0
        return bucket

    def _launch(self, bucket: list) -> None:
        # What the collective reads stays referenced until it is waited for: the compute
        # stream does not reuse that memory while NCCL may still read it.
        self.pending.append((bucket, *self._send(bucket)))
        newest = self.pending[-1][2].nbytes
        self.pending_bytes += newest
        limit = self.IN_FLIGHT_BYTES
        if limit is None:
            return
        while self.pending and (
            limit == 0 or (len(self.pending) > 1 and self.pending_bytes - newest > limit)
        ):
            self._land_oldest()

    def _land_oldest(self) -> None:
        bucket, work, sent, received = self.pending.popleft()
        self.pending_bytes -= sent.nbytes
        self._land(bucket, work, sent, received)

    def _drain(self) -> None:
        if self.bucket:
            self._launch(self._take_bucket())
        while self.pending:
            self._land_oldest()

    def _send(self, bucket: list) -> tuple:
        """Start the bucket's collective: (work, what it reads, what it writes)."""
        raise NotImplementedError

    def _land(self, bucket: list, work, sent: torch.Tensor, received: torch.Tensor) -> None:
        """The collective is done (the compute stream waits for it; the host does not)."""
        raise NotImplementedError


class SummedGradients(GradientBuckets):
    """flash's sink under DDP, in a step's last chunk: each parameter's clipped sum is added to
    its .grad, and the finished gradients are summed over the ranks in buckets. Rank 0 adds the
    step's noise to a bucket before it is summed: once per coordinate. Every collective may be
    pending until finish (the gradients exist anyway; only the small gradients' buckets are
    copies), so the compute stream never waits for one before the last clipped sum."""

    IN_FLIGHT_BYTES = None

    def __init__(self, noise_std: float, add_noise: Callable[[list[torch.Tensor], float], None]):
        super().__init__()
        self.noise_std = noise_std if dist.get_rank() == 0 else 0.0
        self.add_noise = add_noise
        self.handed: set[int] = set()

    def __call__(self, param: nn.Parameter, full: torch.Tensor) -> None:
        full = full.to(param.dtype).view(param.shape)
        if param.grad is None:  # its own storage, as autograd gives it (not a view of a batch)
            param.grad = full if full.untyped_storage().nbytes() == full.nbytes else full.clone()
        else:
            param.grad.add_(full)
        self.handed.add(id(param))
        self._add(param, param.grad)

    def _send(self, bucket):
        grads = [grad for _, grad in bucket]
        if self.noise_std > 0:
            self.add_noise(grads, self.noise_std)
        flat = grads[0] if len(grads) == 1 else torch.cat([g.reshape(-1) for g in grads])
        return dist.all_reduce(flat, async_op=True), flat, flat

    def _land(self, bucket, work, sent, received):
        work.wait()
        if len(bucket) > 1:
            grads = [grad for _, grad in bucket]
            pieces = received.split([g.numel() for g in grads])
            torch._foreach_copy_(grads, [p.view_as(g) for p, g in zip(pieces, grads)])

    def finish(self, params: list[nn.Parameter]) -> None:
        """Sum the parameters not handed over (every one for an empty batch: zero gradients,
        noised all the same), in ``params``' order, then wait for every collective."""
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

    def __init__(self):
        super().__init__()
        self.world_size = dist.get_world_size()

    def __call__(self, param: nn.Parameter, full: torch.Tensor) -> None:
        if not isinstance(param, DTensor):  # a parameter FSDP left unsharded (none today)
            raise TypeError(f"expected an FSDP2-sharded parameter, got {type(param).__name__}")
        # Summed in fp32 at least (a 16-bit parameter's too), a dtype the parameter fixes.
        full = full.to(torch.promote_types(param.dtype, torch.float32))
        padding = -full.shape[0] % self.world_size
        if padding:
            full = torch.cat([full, full.new_zeros((padding, *full.shape[1:]))])
        self._add(param, full)

    def _send(self, bucket):
        # [W, piece] per gradient (a view: dimension 0 split in W), side by side, flattened.
        columns = [full.reshape(self.world_size, -1) for _, full in bucket]
        sent = columns[0] if len(columns) == 1 else torch.cat(columns, dim=1)
        sent = sent.contiguous().view(-1)
        received = sent.new_empty(sent.numel() // self.world_size)
        return dist.reduce_scatter_tensor(received, sent, async_op=True), sent, received

    def _land(self, bucket, work, sent, received):
        work.wait()
        pieces = received.split([full.numel() // self.world_size for _, full in bucket])
        for (param, full), piece in zip(bucket, pieces, strict=True):
            rows = param.to_local().shape[0]
            local = piece.view(-1, *full.shape[1:])[:rows].to(param.dtype)
            if param.grad is None:  # FSDP2's own constructor for its gradients: no autograd
                param.grad = _from_local_no_grad(local, param._spec)  # (from_local's ~10x cost)
            else:
                param.grad.to_local().add_(local)

    def finish(self, params: list[nn.Parameter]) -> None:
        """Send the last bucket and wait for every collective (``params``: as
        SummedGradients.finish; an empty batch hands none over, and optimizer_step gives each
        shard its zeros and noise)."""
        self._drain()


# flash under DDP gathers per-sample gradients instead of summing clipped ones (GatheredGradients)
# at this many ranks: the one count where an all-gather moves no more bytes than an all-reduce.
GATHER_RANKS = 2
# Gathered per-sample gradients of more elements than this travel in a 16-bit step's dtype.
SMALL_GRADIENT_NUMEL = 2**18


def gathers_per_sample(distributed: str, world_size: int, largest: int | None) -> bool:
    """Whether flash's step gathers per-sample gradients: DDP on GATHER_RANKS ranks, one sample
    on the busiest rank (``largest``, the same on every rank, so every rank decides alike)."""
    return distributed == "ddp" and world_size == GATHER_RANKS and largest == 1


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
    ranks seeded alike (shared_generator), so every replica adds the same draw: once per
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
        return torch.promote_types(param.dtype, torch.float32)

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


def shared_generator(device: torch.device) -> torch.Generator:
    """A generator seeded alike on every rank (rank 0's draw): the same noise on every replica.
    Reads the seed on the host: made once, in an eager step (never while a graph captures)."""
    seed = torch.randint(2**62, (1,), device=device)
    dist.broadcast(seed, 0)
    return torch.Generator(device).manual_seed(int(seed.item()))


def gradient_sink(distributed: str, is_last: bool, noise_std: float, add_noise):
    """Where flash hands a chunk's clipped sums instead of .grad: under FSDP2 every chunk's,
    into the shards; under DDP the last chunk's, into the sum over ranks (noise included)."""
    if distributed == "fsdp":
        return ShardedGradients()
    if distributed == "ddp" and is_last:
        return SummedGradients(noise_std, add_noise)
    return None


def local_gradients(params: list[nn.Parameter]) -> list[torch.Tensor]:
    """The tensors a rank holds of each parameter's .grad (a DTensor's local shard)."""
    return [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in params]


def batch_mean(total: float, count: int, device: torch.device, distributed: str) -> float:
    """total / count, summed over the ranks when distributed (the loss of the global batch)."""
    if distributed == "none":
        return total / count
    both = torch.tensor([total, count], dtype=torch.float64, device=device)
    dist.all_reduce(both)
    return (both[0] / both[1]).item()


def chunk_of(inputs: torch.Tensor, targets: torch.Tensor, index: torch.Tensor):
    """(inputs, targets, stand_in) of one physical chunk. Every rank runs as many chunks as the
    rank with the most samples (FSDP2 all-gathers in each chunk's forward); a rank with fewer
    samples gets an empty chunk, which runs one stand-in sample instead (a copy of its first, or
    zeros when it has none) whose loss weighs 0: its gradient, norm and clipped sum are 0."""
    if len(index):
        return inputs[index], targets[index], False
    if len(inputs):
        return inputs[:1], targets[:1], True
    return (
        inputs.new_zeros((1, *inputs.shape[1:])),
        targets.new_zeros((1, *targets.shape[1:])),
        True,
    )


@contextlib.contextmanager
def weighted_zero(trainer, stand_in: bool):
    """While a stand-in chunk runs, the trainer's per-sample loss is multiplied by 0."""
    if not stand_in:
        yield
        return
    loss = trainer.per_sample_loss
    trainer.per_sample_loss = lambda model, x, y: loss(model, x, y) * 0
    try:
        yield
    finally:
        trainer.per_sample_loss = loss


def summed_over_ranks(tensor: torch.Tensor, distributed: str) -> torch.Tensor:
    """``tensor`` summed over the ranks, on the device (no host sync: a graph captures it)."""
    if distributed != "none":
        dist.all_reduce(tensor)
    return tensor


def _reduced(value: int, op, device: torch.device, distributed: str) -> int:
    """``value`` reduced over the ranks by ``op`` (read on the host)."""
    if distributed == "none":
        return value
    reduced = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(reduced, op=op)
    return int(reduced.item())


def on_every_rank(flag: bool, device: torch.device, distributed: str) -> bool:
    """Whether ``flag`` holds on every rank: a decision the ranks must take alike."""
    return bool(_reduced(int(flag), dist.ReduceOp.MIN, device, distributed))


def largest_batch(batch: int, device: torch.device, distributed: str) -> int:
    """The largest of the ranks' batches (a Poisson draw's slices differ by one at most)."""
    return _reduced(batch, dist.ReduceOp.MAX, device, distributed)

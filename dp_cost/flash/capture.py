"""What flash keeps of each managed layer between its forward and release(), recorded without
per-layer Python beyond the layer's own forward.

Each managed module's forward is replaced (an instance attribute, removed by remove(); a module
whose forward another library already replaced is refused) by ``taped_forward``: it computes the
layer's output by its rule's ``compute`` (torch's op, called directly) and appends one record to
the tape: the layer, its input A and the autograd edge its output gradient G will arrive on. No
module hook runs, so ``nn.Module.__call__`` stays on its fast path, and the forward starts no
Python function beyond the model's own. The backward is one autograd call asked for every
recorded edge at once (autograd hands back each G; the managed parameters are frozen, so it
forms no weight gradient). Norm layers are the exception: their G comes by a hook on their
output's node, and their per-sample gradients are formed in the backward, a few layers' at once
(one Python call per such layer). The rules then turn the records into per-sample gradients,
norms and clipped sums by group (flash.engine).

Activation checkpointing: a checkpointed block's forward runs twice, first keeping nothing, then
again at the start of its backward (torch.utils.checkpoint, non-reentrant). Its first forward
records each layer's edge (its output's node: the gradient flows through the first forward's
graph) with an empty holder and keeps no input; the recomputation fills each holder with the
recomputed input, in call order per layer, and records nothing else. Each input is then held once,
from its block's backward to release(), as a plain forward's is from its forward (Tape.phase,
checkpoint_contexts).

nn.DataParallel's replicas are not supported: a replica copies the instance forward, bound to
the original module.

Under autocast a Linear's A is kept in the autocast dtype (the cast the layer multiplies, which
the layer then does not make again); layers reading one input (q, k, v) share that cast."""

from __future__ import annotations

import functools
import operator
import weakref
from collections.abc import Callable

import torch
from torch import Tensor
from torch.autograd.graph import GradientEdge

from dp_cost.flash.checkpointed import (
    FIRST_OF_CHECKPOINTED,
    PLAIN,
    RECOMPUTING,
    CountedLeaf,
    block_contexts,
)
from dp_cost.flash.layer import Call, GradRequest, Layer, add_per_sample, flatten_tokens

# A record's fields (a plain tuple: made in every managed forward, where a class's __init__ would
# be a Python call per layer)
LAYER, INPUT, EDGE, OUTPUT_SHAPE, INPUT_VERSION = range(5)
_new_tuple = tuple.__new__  # GradientEdge / GradRequest without their Python __new__

# A and G held for hooked records (norm layers) whose per-sample gradients wait to be formed
# several at once: formed as soon as they pass a budget, mid-backward (fewer launches than one per
# layer: the 1b model has 49 LayerNorms, a host-bound step at short sequences). The budget is
# DEFERRED_BYTES, or 1 / DEFERRED_PARTS of all hooked records' A and G where that is more: a
# step forms them in at most about DEFERRED_PARTS launches however deep the model, holding at
# most that share of them at once (bytes of the views held, not of the storages they keep alive;
# G counted as the output's bytes in the forward).
DEFERRED_BYTES = 512 * 2**20
DEFERRED_PARTS = 4
_has_pending = operator.attrgetter("pending")


class Tape:
    """One chunk's records, in forward order; ``casts``: the autocast casts made this forward, by
    id(input); ``idle``: record nothing (FlashClipping.autograd_gradients); ``backward_done``:
    the records' gradients were taken (a forward now is an error until release())."""

    __slots__ = (
        "records", "casts", "idle", "backward_done", "hooked", "hooked_bytes", "arrived", "bytes",
        "budget", "full", "phase", "waiting", "blocks", "group_done", "hook_blocks",
    )  # fmt: skip

    def __init__(self, full: Callable[[], None]):
        self.records: list[tuple] = []  # records whose G the backward's autograd call returns
        self.casts: dict[int, tuple] = {}
        self.idle = False
        self.backward_done = False
        # Records whose G a hook takes in the backward (layers whose rule forms their per-sample
        # gradients there: norm layers), by index; those whose G arrived, with it; the bytes
        # of A and G these hold; ``full()``: called when they pass ``budget``.
        self.hooked: list[tuple | None] = []
        self.hooked_bytes = 0  # of all hooked records' A and G, counted in the forward
        self.arrived: list[tuple] = []
        self.bytes = 0
        self.budget = DEFERRED_BYTES  # set at the backward's start
        self.full = full
        self.phase = PLAIN  # set by checkpoint_contexts' contexts
        # The checkpointed block being run: id(layer) -> the holders of its calls in the
        # block's first forward, in call order, that its recomputation fills ([A, A's
        # version]); one such dict per checkpoint call (a module called in several blocks is
        # recomputed in the backward's order, not the forward's), each block's in ``blocks``
        self.waiting: dict[int, list[list]] = {}
        self.blocks: list[dict[int, list[list]]] = []
        # Set (FlashClipping.clip_each_block): every record of a checkpointed block takes its G
        # by a hook, and group_done() is called as each checkpointed block's recomputation
        # starts (the backward of every block after it has ended)
        self.group_done: Callable[[], None] | None = None
        # group_done set and a checkpointed block with records run in this forward: the records
        # made after it (the next blocks', a head's) take G by a hook, clipped with the first
        # group after their G (the first block's are asked for: a branch of it that no
        # asked-for edge lies beyond, LoRA's k and v beside q, would not be run)
        self.hook_blocks = False

    def clear(self) -> None:
        # emptied in place: a hook of a graph still alive finds nothing there (and holds no A)
        self.hooked.clear()
        self.records, self.casts, self.hooked, self.arrived = [], {}, [], []
        self.hooked_bytes = self.bytes = 0
        self.backward_done = False
        for waiting in self.blocks:
            waiting.clear()  # a checkpoint's contexts still alive keep no holder
        self.waiting, self.blocks, self.hook_blocks = {}, [], False
        self.phase = PLAIN  # a context left by an error in it (torch exits none then)

    def __deepcopy__(self, memo) -> Tape:
        """An idle tape: a copied model's forwards compute and record nothing (its engine is
        this tape's, which the copy does not have)."""
        return _idle_tape()

    def __reduce__(self):
        return (_idle_tape, ())


def _idle_tape() -> Tape:
    tape = Tape(lambda: None)
    tape.idle = True
    return tape


def taped_forward(module, tape: Tape, layer: Layer, *args, **kwargs):
    """A managed module's forward: its rule's compute (in the module's own forward's place),
    and a record of A and G's edge. Nothing else here starts a Python function but a norm
    layer's hook registration (a Python call per layer is what this design removes)."""
    x = args[0] if args else next(iter(kwargs.values()))
    if tape.idle or not torch.is_grad_enabled():
        return layer.compute(module, x)
    phase = tape.phase
    if tape.backward_done and phase != RECOMPUTING:
        raise RuntimeError("FlashClipping: call release() before the next forward")
    A = x  # what the record keeps: the input, or its autocast cast
    if phase == FIRST_OF_CHECKPOINTED:
        pass  # nothing kept: autocast casts inside the op, as in the recomputation's other ops
    elif layer.casts_input and x.is_floating_point() and x.dtype != torch.float64:
        device = "cuda" if x.is_cuda else x.device.type
        if torch.is_autocast_enabled(device):
            # The cast autocast would make for this layer's op: made here and handed to the op
            # (which then makes none), kept as A once per input and autocast dtype. q, k and v
            # share that A while x is unchanged; k and v compute on x, cast by autocast as
            # without flash, so the gradient reaching x is summed as it would be (in fp32).
            dtype = torch.get_autocast_dtype(device)
            cached = tape.casts.get(id(x))
            if cached is None or cached[0]() is not x or cached[1:3] != (x._version, dtype):
                cast = x.to(dtype)
                tape.casts[id(x)] = (weakref.ref(x), x._version, dtype, cast)
                A, x = cast, cast
            else:
                A = cached[3]
    if phase == RECOMPUTING:  # the input the block's first forward did not keep
        holders = tape.waiting.get(id(layer))
        if not holders:
            raise RuntimeError(
                f"FlashClipping: {layer.name!r} was recomputed with no call of its checkpointed "
                "forward waiting (one backward per forward: release() first)"
            )
        holders.pop(0).extend((A.detach(), A._version))  # before the op: early stop or not
        y = layer.compute(module, x)
        # as the first forward made it (a counted leaf where nothing before needs a gradient):
        # the recomputation must save what that forward saved
        return y if y.grad_fn is not None else CountedLeaf.apply(y.detach().requires_grad_(True))
    y = layer.compute(module, x)
    base = y._base
    if (
        base is not None
        and base.grad_fn is not None
        and base.numel() == y.numel()
        and y.is_contiguous()
        and base.is_contiguous()
    ):
        # A Linear on [B, T, d] returns a view of its 2-D product; an op in place on the view
        # (ReLU(inplace=True), y += x) takes the view's node out of the graph, the product's
        # stays: G is taken there.
        edge = _new_tuple(GradientEdge, (base.grad_fn, base.output_nr))
        shape = y.shape
    elif y.grad_fn is not None:
        edge, shape = _new_tuple(GradientEdge, (y.grad_fn, y.output_nr)), None
    else:  # nothing before it needs a gradient (e.g. the first layer): a leaf carries G
        y = y.detach().requires_grad_(True)
        edge, shape = y, None
    if phase == FIRST_OF_CHECKPOINTED:  # A comes with the recomputation, into the holder
        holder: list = []
        tape.waiting.setdefault(id(layer), []).append(holder)
        record = (layer, holder, edge, shape, None)
    else:  # A detached: the record holds the input's values, not the autograd graph through it
        record = (layer, A.detach(), edge, shape, A._version)
    if (layer.formed_in_backward or tape.hook_blocks) and y is not edge and tape.records:
        # G by a hook on the output's node: its per-sample gradients are formed in the
        # backward (a few layers' at once), not held to its end (clipped each block: every
        # layer of a checkpointed block's, as the block's backward ends). Not for the first
        # record of a forward: a node no recorded edge lies beyond is not run by the autograd
        # call.
        hook = functools.partial(_hooked_gradient, tape, tape.hooked, len(tape.hooked))
        tape.hooked.append(record)
        tape.hooked_bytes += A.nbytes + y.nbytes
        edge[0].register_prehook(hook)
    else:
        tape.records.append(record)
    return CountedLeaf.apply(y) if phase == FIRST_OF_CHECKPOINTED and y is edge else y


def _hooked_gradient(tape: Tape, hooked: list, index: int, grads: tuple) -> None:
    """A hooked record's G: kept with it; the held ones formed once they pass the budget.
    ``hooked``: the tape's list of the forward that registered the hook (emptied once that
    forward's records are taken or released: a later backward of its graph finds nothing)."""
    if tape.idle or index >= len(hooked):
        return
    record = hooked[index]
    if record is None:  # a second backward through the graph before release()
        raise RuntimeError("FlashClipping: one backward per forward (release() first)")
    G = grads[record[EDGE][1]]
    if G is None:
        return
    hooked[index] = None
    tape.arrived.append((record, G))
    A = record[INPUT]  # a checkpointed call's may come later (its G may precede its A)
    tape.bytes += G.nbytes + ((A[0].nbytes if A else 0) if type(A) is list else A.nbytes)
    if tape.bytes > tape.budget:
        tape.full()


class LayerCapture:
    """The tape's half of FlashClipping (dp_cost.flash.engine): replaces the forward of
    ``layers``' modules and, after the backward, gives each layer its calls (Layer.calls: A and
    G) and the per-sample gradients formed from them at once (Layer.per_sample)."""

    def __init__(self, layers: list[Layer]):
        self.layers = layers
        self.tape = Tape(self._form_arrived)
        # (storage, offset) of each call's G this backward
        self._gradient_owners: set[tuple[int, int]] = set()
        for layer in layers:
            if "forward" in layer.module.__dict__:  # another library's (accelerate's hooks)
                raise ValueError(
                    f"layer {layer.name!r} already has a forward of its own (another library "
                    "replaced it); flash replaces the forward of every layer it manages and "
                    "cannot see the input that one hands the layer"
                )
        self._forwards = {}  # id(module) -> (module, the forward set on it)
        for layer in layers:
            forward = functools.partial(taped_forward, layer.module, self.tape, layer)
            layer.module.forward = forward
            self._forwards[id(layer.module)] = (layer.module, forward)
        self._after_backward = False
        self._replay: tuple | None = None  # what rearm() restores

    def _take_gradients(self, loss: Tensor, retain_graph: bool = False) -> None:
        """The backward: every record's G in one autograd call (hooked records' by their hooks,
        formed on the way), then each call's A and G handed to its layer (Layer.calls), with
        what its rule does with them (Call.pending, .after). ``retain_graph``: the graph and
        the records kept for a second backward (rearm())."""
        tape = self.tape
        records = tape.records
        if tape.backward_done:
            raise RuntimeError("FlashClipping: one backward per forward (release() first)")
        if not records:
            raise RuntimeError("no managed layer was called with grad enabled since release()")
        tape.casts = {}
        tape.backward_done = True
        tape.budget = (  # clipped each block: each block's group consumed as its backward ends
            max(DEFERRED_BYTES, tape.hooked_bytes // DEFERRED_PARTS)
            if tape.group_done is None
            else float("inf")
        )
        self._gradient_owners = set()
        if retain_graph:  # what rearm() restores: the records, the hooks' list and holders
            blocks = [(block, {k: list(v) for k, v in block.items()}) for block in tape.blocks]
            self._replay = (records, tape.hooked, list(tape.hooked), blocks)
        grads = _gradients(loss, [r[EDGE] for r in records], retain_graph)
        tape.records, tape.casts = [], {}  # the last recomputed block's casts: held by calls
        self._add_calls(records, grads, own_gradients=True)
        arrived, tape.arrived, tape.bytes = tape.arrived, [], 0
        self._add_calls([record for record, _ in arrived], [G for _, G in arrived])
        # A hooked record whose G never came adds nothing, as an unused output's: its node did
        # not run (nothing needed its gradient; also where no recorded edge lies beyond it).
        tape.hooked.clear()
        tape.hooked = []

    def rearm(self) -> None:
        """After backward(loss, retain_graph=True): every record ready for a second backward
        through the same graph, as after the forward (a checkpointed block's inputs come again
        from its recomputation in that backward)."""
        if self._replay is None:
            raise RuntimeError("FlashClipping: rearm() needs a backward with retain_graph=True")
        records, hooked, entries, blocks = self._replay
        self._replay = None
        for block, waiting in blocks:
            for holders in waiting.values():
                for holder in holders:
                    holder.clear()
            block.update(waiting)  # each block's dict, which its recomputation's context holds
        hooked[:] = entries  # the list the hooks were given
        tape = self.tape
        tape.records, tape.hooked = records, hooked
        tape.arrived, tape.bytes, tape.backward_done = [], 0, False

    def _form_arrived(self) -> None:
        """The per-sample gradients of the hooked records whose G arrived, now, mid-backward
        (several layers' in one launch per rule); their A and G are dropped."""
        ready = self.take_arrived()
        added = self._add_calls([record for record, _ in ready], [G for _, G in ready])
        self._form_per_sample([(layer, call, call.after) for layer, call in added])

    def take_arrived(self) -> list[tuple]:
        """The arrived (record, G) whose A is there (a checkpointed call's G may come before
        its block's recomputation); the others stay."""
        tape = self.tape
        ready, later = [], []
        for entry in tape.arrived:
            A = entry[0][INPUT]
            (later if type(A) is list and not A else ready).append(entry)
        tape.arrived = later
        tape.bytes = sum(G.nbytes for _, G in later)
        return ready

    def _add_calls(
        self, records: list[tuple], grads, own_gradients: bool = False
    ) -> list[tuple[Layer, Call]]:
        """Each record with its G as a Call of its layer; the (layer, call) added. Builtins only
        in the loop (a Python call per layer is what the tape avoids). ``own_gradients``: give
        each call a G of its own (the clipped GEMM folds c into it in place): one that shares
        another's storage and offset (one gradient for two outputs, y = a + b) is copied."""
        added = []
        for record, G in zip(records, grads, strict=True):
            if G is None:  # the output's gradient never came (an unused output): adds nothing
                continue
            layer, A, version = record[LAYER], record[INPUT], record[INPUT_VERSION]
            if type(A) is list:  # a checkpointed call: its recomputation's [A, version]
                if not A:
                    raise RuntimeError(
                        f"FlashClipping: the checkpointed block of {layer.name!r} was not "
                        "recomputed before its gradient arrived"
                    )
                A, version = A
                record[INPUT].clear()  # held by the call alone (rearm's records hold holders)
            if A._version != version:  # autograd refuses a saved input so changed
                raise RuntimeError(
                    f"FlashClipping: the input of {layer.name!r} was modified in place "
                    "after its forward; its per-sample gradients need it unchanged"
                )
            if record[OUTPUT_SHAPE] is not None:  # the gradient of the view's base
                G = G.view(record[OUTPUT_SHAPE])
            if own_gradients:
                owner = (G.untyped_storage()._cdata, G.storage_offset())  # fake tensors too
                if owner in self._gradient_owners:
                    G = G.clone()
                else:
                    self._gradient_owners.add(owner)
            k_in, k_out = layer.feature_dims
            if A.dim() != k_in + 2:  # [B, T, features] (most calls already are)
                A = flatten_tokens(A, k_in)
            if G.dim() != k_out + 2:
                G = flatten_tokens(G, k_out)
            plan = layer.plans.get((A.shape, G.shape))
            if plan is None:  # once per layer and shapes
                plan = self._plan(layer, A, G)
            layer.described.append(plan[0])
            call = Call()  # no Python __init__: see Call
            call.A, call.G, call.pending, call.after = A, G, plan[1], plan[2]
            layer.calls.append(call)
            added.append((layer, call))
        return added

    @staticmethod
    def _plan(layer: Layer, A: Tensor, G: Tensor) -> tuple[dict, frozenset, frozenset]:
        """(route description, the parameters to do, those of them formed per sample right
        after the backward) of a call: the rule's kept_per_sample (formed at once, where they
        are small) and formed_after_backward; the rest wait for the norms and clipped sums.
        Decided once per layer and shapes, not per chunk (LoRA: hundreds of layers)."""
        rule = layer.rule
        description = {"layer": layer.name, "T": A.shape[1], **rule.describe(layer, A, G)}
        kept = rule.kept_per_sample(layer, A, G)
        after = kept | (rule.formed_after_backward(layer, A, G) & (layer.params.keys() - kept))
        plan = (description, frozenset(layer.params), frozenset(after))
        layer.plans[(A.shape, G.shape)] = plan
        return plan

    def _form_per_sample(self, asked) -> None:
        """The per-sample gradients of ``asked`` (layer, call, names) from each call's A and G,
        one per_sample_grads_many per rule (a rule may share launches between its calls); the
        names leave each call's pending."""
        by_rule: dict = {}
        for entry in asked:
            by_rule.setdefault(entry[0].rule, []).append(entry)
        for rule, entries in by_rule.items():
            requests = [_new_tuple(GradRequest, (ly, c.A, c.G, names)) for ly, c, names in entries]
            grads = rule.per_sample_grads_many(requests)
            for (layer, call, names), formed in zip(entries, grads, strict=True):
                if layer.per_sample:
                    add_per_sample(layer, formed)
                else:  # a layer's first call (most layers have one): the dict itself
                    layer.per_sample = formed
                call.pending = call.pending - names
                if not call.pending:  # nothing left to do from A and G: drop the call
                    layer.calls = list(filter(_has_pending, layer.calls))

    def _recorded_inputs(self):
        """(module, A) of every call recorded this forward and not yet taken by a backward, in
        the layers' order (hooked records are listed apart from the others)."""
        tape = self.tape
        records = tape.records + [r for r in tape.hooked if r is not None]
        order = {id(layer): i for i, layer in enumerate(self.layers)}
        records.sort(key=lambda record: order[id(record[LAYER])])
        inputs = [(record[LAYER].module, record[INPUT]) for record in records]
        # a checkpointed call's input: once recomputed
        return [(m, A[0] if type(A) is list else A) for m, A in inputs if type(A) is not list or A]

    def checkpoint_contexts(self) -> tuple:
        """torch.utils.checkpoint's ``context_fn`` (dp_cost.core.recompute): the contexts of a
        checkpointed block's first forward and of its recomputation."""
        return block_contexts(self.tape)

    def _remove_forwards(self) -> None:
        """Take off the forwards set here (one another library set on a module later stays; the
        taped forward it may call records nothing from now on)."""
        self.tape.idle = True
        for module, forward in self._forwards.values():
            if module.__dict__.get("forward") is forward:
                del module.forward
        self._forwards = {}


def _gradients(loss: Tensor, edges: list, retain_graph: bool = False) -> tuple:
    """torch.autograd.grad(loss, edges, allow_unused=True) by the engine call autograd.grad
    makes itself, where loss is a plain tensor: autograd.grad first checks each input for a
    tensor subclass, two Python calls per input (per layer call), and the tape's edges and
    leaves are plain. Anything else goes through autograd.grad."""
    run_backward = getattr(torch.autograd.graph, "_engine_run_backward", None)
    if run_backward is None or type(loss) is not torch.Tensor:
        return torch.autograd.grad(loss, edges, allow_unused=True, retain_graph=retain_graph)
    seed = torch.ones_like(loss, memory_format=torch.preserve_format)
    return run_backward(
        (loss,), (seed,), retain_graph, False, tuple(edges), True, accumulate_grad=False
    )

"""backward() and grad(): one Backward command per mesh the graph spans, whatever its size.

The controller never replays the graph op by op: the workers recorded it with torch's autograd
while running the forward (RunOp `grad`), so the controller only walks its small node graph
(dtorch/dtensor/recording.py) to find the leaves to bind and the pipeline hops to cross. A graph on one
mesh is one command. A graph that crosses meshes (pipeline stages) is one command per stage and
hop, depth first: the last stage's backward, its gradient moved back to the previous stage, that
stage's backward, and so on; each stage's workers run their own commands in order, so stage s
works on one microbatch's backward while stage s-1 works on the one before.
"""
from __future__ import annotations

import contextlib
import threading

from ..errors import user_site
from ..dtensor.factories import ones
from ..dtensor.recording import HopNode, Leaf, OpNode, no_grad
from ..runtime.controller import profiling
from ..dtensor import compile_capture as capturing
from ..dtensor import frontend_state
from ..runtime.protocol import Backward, SetGrads
from ..spec.placements import Replicate
from ..dtensor.tensor import DTensor, call_op
from ..ops.tensor_meta import tensor_meta
from .hooks import has_hooks, run_hooks, run_post_hooks
from .retained import clear_retained, retained_accumulator, retained_grad, retained_in
from .placement_rules import gradient_placements, reduction_buckets

__all__ = ["backward", "backward_stages", "grad", "leaf_grad", "set_leaf_grad", "clear_grads", "reduce_gradients",
           "no_sync"]


class _Sync(threading.local):   # per thread, as grad mode is
    deferred = False


_sync = _Sync()


@contextlib.contextmanager
def no_sync():
    """Backward calls inside accumulate data-parallel gradients without reducing them (DDP's
    no_sync): the reduction then happens once, when the gradients are read (an optimizer step,
    `param.grad`). Outside it, each backward all-reduces them while it runs."""
    before, _sync.deferred = _sync.deferred, True
    try:
        yield
    finally:
        _sync.deferred = before


def backward(tensors, grad_tensors=None, retain_graph=None, create_graph=False, inputs=None) -> None:
    """torch.autograd.backward: gradients of `tensors` accumulate into the `.grad` of every leaf
    they depend on (only those of `inputs`, if given)."""
    with profiling.span("backward", "autograd"):
        _backward(tensors, grad_tensors, retain_graph, create_graph, inputs)


def _backward(tensors, grad_tensors, retain_graph, create_graph, inputs) -> None:
    roots, seeds = _roots_and_seeds(tensors, grad_tensors, create_graph, "backward")
    only = None if inputs is None else {id(t._node) for t in _as_list(inputs)}
    retain = bool(retain_graph)
    shared = _shared_nodes([r._node for r in roots])
    pending, walked = [(roots, seeds)], []
    while pending:
        roots, seeds = pending.pop()
        # Data-parallel gradients are reduced inside a backward that is one segment: across
        # pipeline hops a leaf may gain more gradient from a later segment, so those wait for the read.
        reduce = not walked and not _sync.deferred
        hops, reached = _run_segment(roots, seeds, retain, only, shared, drop_hops=not retain, reduce=reduce)
        walked.append(reached)
        pending += reversed(hops)
    run_post_hooks([leaf for reached in walked for leaf in reached.leaves])
    if not retain:
        for reached in walked:
            reached.release()


def backward_stages(loss):
    """Backward of a scalar over pipeline stages one stage at a time, for a schedule (1F1B) that
    interleaves it with other microbatches' forwards: a generator that runs the next stage's
    Backward command at each next() (last stage first) and stops after the first stage. The
    workers keep the graph (shared nodes, such as fully sharded parameters gathered once for
    every microbatch, are run through again by the next microbatch); it goes when its tensors do."""
    pending = [tuple(_roots_and_seeds([loss], None, False, "backward"))]
    del loss   # held by pending only: its graph goes once the next stages no longer need it
    leaves = []
    while pending:
        roots, seeds = pending.pop()
        hops, reached = _run_segment(roots, seeds, True, None, set(), drop_hops=True)
        pending += reversed(hops)
        leaves += reached.leaves
        del roots, seeds, hops, reached   # not held across the yield: this stage's graph goes now
        yield
    run_post_hooks(leaves)


def grad(outputs, inputs, grad_outputs=None, retain_graph=None, create_graph=False, allow_unused=None,
         materialize_grads=False):
    """torch.autograd.grad: the gradients of `outputs` w.r.t. `inputs`, returned (nothing
    accumulates), each in its input's own placements. One mesh only (no pipeline hops)."""
    roots, seeds = _roots_and_seeds(outputs, grad_outputs, create_graph, "grad")
    wanted = _as_list(inputs)
    for tensor in wanted:
        if tensor._node is None:
            raise RuntimeError(f"autograd.grad at {user_site()}: one of the inputs does not require grad")
    mesh = roots[0].device_mesh
    reached = _walk(roots, None, mesh)
    if reached.hops:
        raise NotImplementedError("dtorch.autograd.grad across meshes (pipeline stages) is not supported yet; "
                                  "use backward() and read .grad")
    missing = [i for i, t in enumerate(wanted) if id(t._node) not in reached.seen]
    if missing and not (allow_unused or materialize_grads):
        raise RuntimeError(f"autograd.grad at {user_site()}: input {missing[0]} was not used in the graph "
                           "(set allow_unused=True if this is the desired behavior)")
    controller = roots[0]._controller
    out_ids = controller.new_ids(len(wanted))
    controller.submit(Backward, controller.define_mesh(mesh), _ids(roots), _ids(seeds), _ids(wanted), out_ids,
                      "grad", bool(retain_graph))
    if not retain_graph:
        reached.release()
    found = []
    with no_grad():
        for index, (tensor, out_id) in enumerate(zip(wanted, out_ids)):
            spec = tensor_meta(tensor.shape, tensor.dtype, mesh, gradient_placements(tensor.placements))
            result = DTensor(out_id, spec, -1, controller)
            if has_hooks(tensor) and index not in missing:
                result = run_hooks(tensor, result)
            found.append(None if index in missing and not materialize_grads
                         else result.redistribute(placements=tensor.placements))
    return tuple(found)


# --- leaves' gradients -------------------------------------------------------------------------------
def leaf_grad(tensor: DTensor):
    """`tensor.grad`: the accumulated gradient in the tensor's own placements. A Replicate leaf's
    gradient accumulates as P(sum) on the workers; the first read reduces it (and rebinds the
    workers' .grad to the reduced tensor)."""
    leaf = tensor._node
    if type(leaf) is not Leaf:
        return retained_grad(tensor)   # an intermediate's, if retain_grad() kept it (else None)
    if leaf.grad is None:
        return None
    if leaf.grad.placements != tensor.placements:
        with no_grad():
            _bind(tensor, leaf, leaf.grad.redistribute(placements=tensor.placements))
    return leaf.grad


def reduce_gradients(tensors) -> None:
    """Bring the pending gradients of many leaves to their tensors' placements at once (what an
    optimizer step or a global clip reads): those whose only difference is P(sum) -> Replicate
    (data-parallel parameters) are flattened into one buffer per mesh and dtype and reduced with
    ONE all-reduce, as DDP's buckets are; any other pending gradient is reduced on its own."""
    buckets = {}
    for tensor in tensors:
        leaf = tensor._node
        if type(leaf) is not Leaf or leaf.grad is None or leaf.grad.placements == tensor.placements:
            continue
        if all(p == Replicate() for p in tensor.placements) and tensor.device_mesh.size() > 1:
            buckets.setdefault((tensor.device_mesh, tensor.dtype), []).append(tensor)
        else:   # on one rank the "reduction" is a relabel: nothing to flatten
            leaf_grad(tensor)
    with no_grad():
        for bucket in buckets.values():
            if len(bucket) == 1:
                leaf_grad(bucket[0])
                continue
            flat = call_op("cat", ([t._node.grad.reshape(-1) for t in bucket],), {})
            reduced = flat.redistribute(placements=bucket[0].placements)
            pieces = reduced.split([t.numel() for t in bucket])
            for tensor, piece in zip(bucket, pieces):
                _bind(tensor, tensor._node, piece.view(tuple(tensor.shape)))


def set_leaf_grad(tensor: DTensor, value) -> None:
    """`tensor.grad = value` (None clears it, as zero_grad(set_to_none=True) does)."""
    leaf = tensor._node
    if type(leaf) is not Leaf:
        if value is None:
            clear_retained(tensor)
            return
        raise RuntimeError(f"assigning .grad at {user_site()}: dtorch sets gradients of leaves that require grad "
                           "only (an intermediate's .grad, kept by retain_grad(), can only be cleared: = None)")
    if value is None:
        clear_grads([tensor])
        return
    if not isinstance(value, DTensor) or tuple(value.shape) != tuple(tensor.shape):
        raise RuntimeError(f"assigned grad has data of a different size at {user_site()}: "
                           f"{getattr(value, 'shape', type(value).__name__)} for a tensor of shape "
                           f"{tuple(tensor.shape)}")
    if value.dtype != tensor.dtype:
        raise RuntimeError(f"assigned grad has data of a different type at {user_site()}: {value.dtype} for a "
                           f"{tensor.dtype} tensor")
    with no_grad():
        value = value.redistribute(tensor.device_mesh, tensor.placements)
    _bind(tensor, leaf, value)


def clear_grads(tensors: list) -> None:
    """`t.grad = None` for each leaf in one SetGrads command (zero_grad(set_to_none=True))."""
    leaves = [t for t in tensors if type(t._node) is Leaf]
    for tensor in leaves:
        _touch(tensor._node, resets=True)
        tensor._node.grad = tensor._node.bound = None
    if leaves:
        leaves[0]._controller.submit(SetGrads, tuple([t._id for t in leaves]), (-1,) * len(leaves))


def _bind(tensor: DTensor, leaf: Leaf, grad: DTensor) -> None:
    _touch(leaf)
    tensor._controller.submit(SetGrads, (tensor._id,), (grad._id,))
    leaf.grad, leaf.bound = grad, grad._id


def _touch(leaf: Leaf, resets: bool = False) -> None:
    """dtorch.compile's capture learns which .grad a call changes (a replay sets them again)."""
    capture = capturing.active()
    if capture is not None:
        capture.touch_leaf(leaf, resets)


# --- one mesh's part ---------------------------------------------------------------------------------
class _Reached:
    """What a walk from the roots found on one mesh: leaves, pipeline hops, the nodes seen."""

    def __init__(self):
        self.leaves, self.hops, self.seen, self.nodes = [], [], set(), []

    def release(self) -> None:
        for node in self.nodes:
            node.released = True


def _walk(roots, only, mesh) -> _Reached:
    reached, stack = _Reached(), [r._node for r in roots]
    while stack:
        node = stack.pop()
        if id(node) in reached.seen:
            continue
        reached.seen.add(id(node))
        if type(node) is Leaf:
            tensor = node.tensor()
            if tensor is not None and (only is None or id(node) in only):
                reached.leaves.append(tensor)
            continue
        if node.released:
            raise RuntimeError(f"backward at {user_site()}: trying to backward through the graph a second time (or "
                               "directly access saved tensors after they have already been freed). Specify "
                               "retain_graph=True if you need to backward through the graph a second time")
        if type(node) is HopNode:
            reached.hops.append(node)
            continue
        if node.mesh != mesh:
            raise NotImplementedError(f"backward at {user_site()}: the graph holds ops on {node.mesh} and on {mesh} "
                                      "without a move between them")
        reached.nodes.append(node)
        stack.extend(node.inputs)
    return reached


def _shared_nodes(starts: list) -> set:
    """Ids of the nodes more than one mesh segment reaches (a parameter gathered once and used by
    every microbatch of a pipeline): each segment's Backward runs through them with their part
    of the gradient, so the segments before the last keep the workers' graph there."""
    counts, segments = {}, [starts]
    while segments:
        stack, seen = list(segments.pop()), set()
        while stack:
            node = stack.pop()
            if id(node) in seen:
                continue
            seen.add(id(node))
            if type(node) is HopNode and node.source is not None:
                segments.append([node.source._node])
            elif type(node) is OpNode:
                stack.extend(node.inputs)
        for key in seen:
            counts[key] = counts.get(key, 0) + 1
    return {key for key, count in counts.items() if count > 1}


def _run_segment(roots, seeds, retain: bool, only, shared: set, drop_hops: bool,
                 reduce: bool = False) -> tuple[list, _Reached]:
    """Backward on the roots' mesh up to its leaves and hops; returns the (roots, seeds) each hop
    continues with on its source mesh, and what the walk reached. With drop_hops (no second
    backward will cross them) each hop lets go of its two ends, so the workers free them, and
    what hangs off them, as soon as the continuation has run rather than when the loss goes.
    With `reduce` and no hops, Replicate leaves' gradients are all-reduced in buckets while the
    workers' backward runs (rules.reduction_buckets) and come out in their tensors' placements."""
    mesh = roots[0].device_mesh
    reached = _walk(roots, only, mesh)
    retain = retain or any(id(node) in shared for node in reached.nodes)
    controller = roots[0]._controller
    leaves = sorted(reached.leaves, key=lambda t: t._id)   # creation order: the buckets' order
    hooked = {i for i, leaf in enumerate(leaves) if has_hooks(leaf)}   # their gradient comes apart
    buckets = _buckets(leaves, hooked, mesh.shape) if reduce and not reached.hops else []
    reduced = {i: dims for dims, members in buckets for i in members}
    grads = [_accumulator(leaf, reduced.get(i, ()), fresh=i in hooked) for i, leaf in enumerate(leaves)]
    # intermediates the user called retain_grad() on: after the leaves (the buckets number those)
    kept = retained_in(reached.nodes) if only is None else []
    kept_grads = [retained_accumulator(tensor, record) for tensor, record in kept]
    landed_ids = controller.new_ids(len(reached.hops))
    seq = controller.submit(Backward, controller.define_mesh(mesh), _ids(roots), _ids(seeds),
                            _ids(leaves) + _ids(t for t, _ in kept) + tuple([hop.landed._id for hop in reached.hops]),
                            _ids(grads) + _ids(kept_grads) + landed_ids, "backward", retain,
                            tuple([(dims, tuple(members)) for dims, members in buckets]))
    for i in reduced:   # bound on the workers by the Backward itself
        leaves[i]._node.grad = grads[i]
        grads[i]._seq = seq
    for holder, grad in zip([leaf._node for leaf in leaves] + [record for _, record in kept], grads + kept_grads):
        holder.bound = grad._id   # each worker's .grad is now the tensor under that id
    for i in sorted(hooked):
        _accumulate_hooked(leaves[i], grads[i], seq)
    if reached.hops:   # a landed tensor's gradient is taken, not kept accumulating on its leaf
        controller.submit(SetGrads, tuple([hop.landed._id for hop in reached.hops]), (-1,) * len(reached.hops))
    continuations = [_hop_back(hop, landed_id, controller) for hop, landed_id in zip(reached.hops, landed_ids)]
    if drop_hops:
        for hop in reached.hops:
            hop.source = hop.landed = None
            hop.released = True
    return continuations, reached


def _buckets(leaves: list, hooked: set, mesh_shape: tuple) -> list:
    """rules.reduction_buckets over the leaves without hooks, numbered in `leaves`."""
    plain = [i for i in range(len(leaves)) if i not in hooked]
    if not hooked:
        return reduction_buckets(leaves, mesh_shape)
    return [(dims, [plain[j] for j in members])
            for dims, members in reduction_buckets([leaves[i] for i in plain], mesh_shape)]


def _accumulate_hooked(tensor: DTensor, incoming: DTensor, seq: int) -> None:
    """A leaf with hooks: its .grad becomes the old one plus the hooks' result on this backward's
    gradient (autograd/hooks.py), in gradient placements."""
    leaf, wanted = tensor._node, gradient_placements(tensor.placements)
    incoming._seq = seq
    total = run_hooks(tensor, incoming)
    with no_grad():   # each side moved explicitly: strict mode refuses an inserted move
        if total.placements != wanted:
            total = total.redistribute(placements=wanted)
        if leaf.grad is not None:
            old = leaf.grad if leaf.grad.placements == wanted else leaf.grad.redistribute(placements=wanted)
            total = old + total
    if leaf.bound == total._id:   # no hook and no old gradient: the Backward bound it already
        leaf.grad = total
    else:
        _bind(tensor, leaf, total)


def _accumulator(tensor: DTensor, reduced_dims: tuple = (), fresh: bool = False) -> DTensor:
    """The DTensor a leaf's gradient accumulates into on the workers, in gradient placements: a
    gradient read since the last backward (hence reduced) goes back to them first. With
    `reduced_dims` the backward all-reduces it over those dims: what it returns is then a new
    DTensor, Replicate there, that the caller binds after the Backward (the workers bind it there).
    `fresh`: a new DTensor whatever .grad holds, for this backward's gradient alone (hooks)."""
    leaf, wanted = tensor._node, gradient_placements(tensor.placements)
    _touch(leaf)   # a capture's backward builds on this gradient (or on none): a replay needs the same
    if fresh and leaf.bound is not None:   # torch's engine would add into the workers' .grad in place
        tensor._controller.submit(SetGrads, (tensor._id,), (-1,))
        leaf.bound = None
    if not fresh:
        if leaf.grad is not None and leaf.bound != leaf.grad._id:   # an in-place op on .grad rebound it
            _bind(tensor, leaf, leaf.grad)                          # here only: the workers' .grad follows first
        if leaf.grad is not None and leaf.grad.placements != wanted:
            with no_grad():
                _bind(tensor, leaf, leaf.grad.redistribute(placements=wanted))
        if not reduced_dims and leaf.grad is not None:
            return leaf.grad
    placements = [Replicate() if dim in reduced_dims else p for dim, p in enumerate(wanted)]
    controller = tensor._controller
    made = DTensor(controller.new_id(), tensor_meta(tensor.shape, tensor.dtype, tensor.device_mesh, placements),
                   -1, controller)
    if not (reduced_dims or fresh):
        leaf.grad = made
    return made


def _hop_back(hop: HopNode, landed_id: int, controller) -> tuple:
    landed, source = hop.landed, hop.source
    spec = tensor_meta(landed.shape, landed.dtype, landed.device_mesh, gradient_placements(landed.placements))
    with no_grad():
        moved = DTensor(landed_id, spec, -1, controller).redistribute(source.device_mesh,
                                                                      gradient_placements(source.placements))
    return [source], [moved]


# --- arguments ---------------------------------------------------------------------------------------
def _roots_and_seeds(tensors, grads, create_graph: bool, what: str):
    frontend_state.refuse_inside_checkpoint(what)
    if create_graph:
        raise NotImplementedError(f"{what}(create_graph=True) (higher-order gradients) is not supported yet")
    roots = [_reduced_root(root) for root in _as_list(tensors)]
    grads = [None] * len(roots) if grads is None else _as_list(grads, allow_none=True)
    if len(grads) != len(roots):
        raise RuntimeError(f"{what} at {user_site()}: {len(grads)} gradients for {len(roots)} tensors")
    meshes = {r.device_mesh for r in roots}
    if len(meshes) > 1:
        raise NotImplementedError(f"{what} at {user_site()}: roots on several meshes; call it once per mesh")
    seeds = []
    with no_grad():
        for root, given in zip(roots, grads):
            if root._node is None:
                raise RuntimeError(f"{what} at {user_site()}: element 0 of tensors does not require grad and does "
                                   "not have a grad_fn")
            seeds.append(_seed(root, given, what))
    return roots, seeds


def _reduced_root(root):
    """A root held P(avg|max|min) is reduced first, inside the graph: its parts' gradients are
    then the reduction's own backward (an average's 1/n each, a max's to the winners), where a
    seed in some placement could not say how they split."""
    if not isinstance(root, DTensor) or root._node is None or not any(_unsummed(p) for p in root.placements):
        return root
    return root.redistribute(placements=[Replicate() if _unsummed(p) else p for p in root.placements])


def _unsummed(placement) -> bool:
    return placement.is_partial() and placement.reduce_op != "sum"


def _seed(root: DTensor, given, what: str) -> DTensor:
    wanted = gradient_placements(root.placements)
    if given is None:
        if root.numel() != 1:
            raise RuntimeError(f"{what} at {user_site()}: grad can be implicitly created only for scalar outputs "
                               f"(this one has shape {tuple(root.shape)}); pass a gradient")
        return ones(tuple(root.shape), dtype=root.dtype, device_mesh=root.device_mesh, placements=wanted)
    if not isinstance(given, DTensor):
        raise TypeError(f"{what} at {user_site()}: a gradient must be a DTensor, got {type(given).__name__}")
    if tuple(given.shape) != tuple(root.shape):
        raise RuntimeError(f"{what} at {user_site()}: Mismatch in shape: grad_output has a shape of "
                           f"{tuple(given.shape)} and output has a shape of {tuple(root.shape)}")
    return given.to(root.dtype).redistribute(root.device_mesh, wanted)


def _as_list(value, allow_none: bool = False) -> list:
    if isinstance(value, DTensor) or (allow_none and value is None):
        return [value]
    return list(value)


def _ids(tensors) -> tuple:
    return tuple([t._id for t in tensors])

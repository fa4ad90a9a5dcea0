"""Which DTensors are views of which: the bookkeeping behind torch's aliasing (docs/reference/inplace.md).

A dtorch view op (x[0], x.T, x.view(...), x.chunk(2)[1], ...) makes a new symbol with its own
buffers, so aliasing is bookkeeping: each result of a view op gets a `Node` that remembers its
base's node and the step that made it. dtorch/dtensor/inplace.py walks these nodes when a tensor changes
in place, to write a view's change back into its base and re-derive the base's other views.

Cost: op_issue.call_op calls `note_view` only for the ops in VIEW_OPS (one node per view, plus one
for a base the first time); a tensor that never had a view made from it (and is not one) has no
node, and nothing else on the hot path looks here.
Nodes hold their objects weakly: a view never keeps its base's buffers alive. A dead node stays
in the tree (a "ghost") while it has live descendants, so that they still reach their live
ancestors; its value is re-derived from its parent when needed.

Whether torch itself would alias (x.T.reshape(-1) copies, x.reshape(-1) does not) is decided
the way torch decides it: the chain of steps is replayed on strided meta tensors from the root.
"""
from __future__ import annotations

import weakref

from ..ops import REGISTRY

__all__ = ["VIEW_OPS", "Node", "note_view", "node_of", "aliases", "tracking_paused", "forget", "hand_over"]

# Ops whose result is a view of their first argument in torch (when torch does not copy:
# `aliases` decides). getitem here is basic indexing only; tensor indices copy. detach (and so
# x.data) shares x's memory without its autograd history: `p.data.mul_(0.5)` changes p.
VIEW_OPS = frozenset({"getitem", "view", "reshape", "flatten", "unflatten", "squeeze", "unsqueeze", "transpose",
                      "permute", "expand", "contiguous", "split", "chunk", "unbind", "narrow", "detach", "diagonal",
                      "unfold"})


class Node:
    """One tracked DTensor: its weak reference, its TensorMeta (fixed: in-place ops keep shape,
    dtype and placements), its parent node and the step (op, args after the base, kwargs,
    output index or None) that made it from the parent, and its children by key. `keep`: the
    hidden base a tensor changed by x.transpose_() is a view of (hand_over), held as long as
    this node is, as torch's storage lives as long as a view of it."""
    __slots__ = ("ref", "key", "meta", "parent", "step", "children", "keep", "_strided", "_aliases", "__weakref__")

    def __init__(self, obj, parent: Node | None, step):
        self.key, self.meta, self.parent, self.step, self.children = id(obj), obj._meta, parent, step, {}
        self.ref = weakref.ref(obj, _died_callback(self.key))
        self._strided, self._aliases, self.keep = None, None, None

    def track(self, obj) -> None:
        """This node stands for `obj` from now on (hand_over)."""
        old, self.key = self.key, id(obj)
        self.ref = weakref.ref(obj, _died_callback(self.key))   # the old reference dies uncalled
        if self.parent is not None:
            del self.parent.children[old]
            self.parent.children[self.key] = self
        _NODES[self.key] = self

    def obj(self):
        return self.ref()


_NODES: dict[int, Node] = {}      # id(live object) -> its node
_paused = [0]                     # > 0 while dtorch/dtensor/inplace.py re-derives views (its temporaries are not views)


class tracking_paused:
    """with tracking_paused(): view ops issued inside make no nodes."""
    def __enter__(self):
        _paused[0] += 1

    def __exit__(self, *exc):
        _paused[0] -= 1


def node_of(obj) -> Node | None:
    return _NODES.get(id(obj))


def note_view(name: str, args: tuple, kwargs: dict, result) -> None:
    """op_issue.call_op's hook for VIEW_OPS: each output becomes a child of args[0]'s node."""
    base = args[0]
    if _paused[0] or not hasattr(base, "_meta"):
        return
    parent = _NODES.get(id(base))
    if parent is None:
        parent = _NODES[id(base)] = Node(base, None, None)
    several = isinstance(result, (tuple, list))
    for index, out in enumerate(result if several else (result,)):
        child = Node(out, parent, (name, args[1:], dict(kwargs) if kwargs else {}, index if several else None))
        parent.children[child.key] = child
        _NODES[child.key] = child


def _died_callback(key: int):
    def died(_ref):
        node = _NODES.pop(key, None)
        if node is not None:
            prune(node)
    return died


def prune(node: Node) -> None:
    """Drop dead nodes without children, upwards. A live node stays while its object lives: a
    view may write back, and a base that had a view is likely to get the next one (x.T in every
    step), which then costs one node, not two."""
    while node is not None and not node.children and node.ref() is None:
        parent, node.parent = node.parent, None
        if parent is not None:
            parent.children.pop(node.key, None)
        node = parent


def detach(node: Node) -> None:
    """`node` stops being a view (its root died and no other view of that root lives): it
    becomes a root. Its strided layout is fixed first, so its own views keep torch's answer."""
    strided(node)
    parent, node.parent, node.step = node.parent, None, None
    if parent is not None:
        parent.children.pop(node.key, None)
        prune(parent)


def forget(obj) -> None:
    """`obj` takes other memory (`p.data = t`): its node stays in the tree as a ghost, so the
    views made of it keep its old values (torch's keep the old storage), and `obj` starts afresh."""
    node = _NODES.pop(id(obj), None)
    if node is not None:
        node.ref = _gone
        prune(node)


def hand_over(obj, holder, view) -> None:
    """x.transpose_(0, 1) and kin (dtorch/dtensor/inplace.py): `view` was just made from `obj`, and `obj`
    takes its place, a view of its own old value, which `holder` (a hidden DTensor) now carries.
    Views made of obj before stay views of that value, and obj's later changes reach them (torch's
    share one storage): obj's node now stands for holder, view's for obj, which keeps holder."""
    node, child = _NODES.pop(id(obj)), _NODES.pop(id(view))
    assert child.parent is node, "the view must be fresh from obj"
    node.track(holder)
    child.track(obj)
    child.keep = holder


def _gone():
    return None


def strided(node: Node):
    """The node as torch would lay it out: a meta tensor with the strides of its view chain."""
    if node._strided is None:
        if node.parent is None:
            node._strided, node._aliases = node.meta.meta(), False
        else:
            base = strided(node.parent)
            name, rest, kwargs, index = node.step
            out = REGISTRY[name].torch_fn(base, *rest, **kwargs)
            out = out if index is None else out[index]
            # detach shares its input's memory, yet torch does not call its result a view
            node._aliases = out is base or out._is_view() or name == "detach"
            node._strided = out if node._aliases else node.meta.meta()
    return node._strided


def aliases(node: Node) -> bool:
    """Does torch make this node a view of its parent (rather than a copy)?"""
    strided(node)
    return node._aliases

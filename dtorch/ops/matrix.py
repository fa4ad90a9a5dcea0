"""PURE: matrix products, whose rules all derive from an einsum equation.

On one mesh dim, with the equation's letters:
  all R                         -> R
  one P(sum|avg), the rest R    -> the same Partial (products are linear in each operand)
  S on letter L (any inputs)    -> every input holding L is sharded on it (R is sliced locally),
                                   inputs without L stay R; L kept in the output -> S(L's position),
                                   L contracted away -> P(sum)
"mk,kn->mn" thus gives S(0)xR -> S(0), RxS(1) -> S(1), S(1)xS(0) -> P(sum).
A repeated letter (trace's "ii->", einsum's diagonals) must not be sharded: a shard holds rows
[a, b) of one dim but columns [c, d) of the other, so its diagonal is not the global one.

cross (3-vectors along `dim`) is bilinear like a product: one P(sum|avg) input beside R passes,
and shards of any other dim pass as a pointwise op's do (R sliced, broadcast dims R).

Ops that add a term to a product (linear's bias, baddbmm's input) place it like the product's
result: R with R, S on the matching dim (or R when broadcast), P(sum) with P(sum); a P(avg)
product takes an R term (averaging keeps an added constant); an R product takes a P(avg|max|min)
term (a shift keeps averages and order).
"""
from __future__ import annotations

import string

import torch

from ..spec.placements import Partial, Shard
from .pointwise import shard_decision
from .registry import OpRow, register_family
from .rules import Call, Decision, R, RuleRejected

__all__ = ["MATRIX", "einsum_rule", "einsum_decision", "matmul_equation", "explicit_equation"]

_LEGAL = "all R; one P(sum) with R; S on one einsum letter (inputs without it R)"


def _parse(equation: str) -> tuple[list[str], str]:
    inputs, output = equation.replace(" ", "").split("->")
    return inputs.split(","), output


def _letter_decision(call: Call, placements, letters, out, letter) -> Decision:
    required = []
    for spec, p, held in zip(call.inputs, placements, letters):
        if letter not in held:
            if not p.is_replicate():
                raise RuleRejected(f"an input without letter {letter!r} is {p!r}", _LEGAL)
            required.append(p)
            continue
        dim = held.index(letter)
        broadcast = spec.shape[dim] == 1 and _letter_size(call, letters, letter) != 1
        if broadcast and not p.is_replicate():
            raise RuleRejected(f"S({dim}) is on a broadcast dim of size 1", _LEGAL)
        required.append(p if broadcast else Shard(dim))
    result = Shard(out.index(letter)) if letter in out else Partial("sum")
    return Decision(tuple(required), (result,))


def _letter_size(call: Call, letters, letter) -> int:
    return max(spec.shape[held.index(letter)] for spec, held in zip(call.inputs, letters) if letter in held)


def einsum_decision(call: Call, placements, equation: str) -> Decision:
    letters, out = _parse(equation)
    partials = [p for p in placements if isinstance(p, Partial)]
    sharded_letters = {held[p.dim] for p, held in zip(placements, letters) if isinstance(p, Shard)}
    if partials:
        if len(partials) == 1 and not sharded_letters and partials[0].reduce_op in ("sum", "avg"):
            return Decision(placements, (partials[0],))
        raise RuleRejected("a product takes at most one Partial input, with every other input R", _LEGAL)
    if not sharded_letters:
        return Decision(placements, (R,))
    if len(sharded_letters) > 1:
        raise RuleRejected(f"inputs are sharded on different letters {sorted(sharded_letters)} of "
                           f"{equation!r}", _LEGAL)
    return _letter_decision(call, placements, letters, out, sharded_letters.pop())


def einsum_rule(equation_of):
    """A rule from a function call -> einsum equation (fixed for mm, rank-dependent for matmul)."""
    def rule(call: Call, placements) -> Decision:
        return einsum_decision(call, placements, equation_of(call))
    return rule


def matmul_equation(call: Call) -> str:
    """torch.matmul's rank cases as one einsum equation, batch dims broadcast from the right."""
    a, b = (len(spec.shape) for spec in call.inputs)
    batch = string.ascii_lowercase[:max(a, b, 2) - 2]
    if a == 1 and b == 1:
        return "y,y->"
    if a == 1:
        return f"y,{batch[len(batch) - (b - 2):]}yz->{batch[len(batch) - (b - 2):]}z"
    if b == 1:
        return f"{batch[len(batch) - (a - 2):]}xy,y->{batch[len(batch) - (a - 2):]}x"
    a_batch, b_batch = batch[len(batch) - (a - 2):], batch[len(batch) - (b - 2):]
    return f"{a_batch}xy,{b_batch}yz->{batch}xz"


# --- einsum: the user's equation, made explicit -------------------------------------------------
def explicit_equation(equation: str, ranks) -> str:
    """`...` expanded to fresh letters (broadcast from the right) and the implicit output made
    explicit (torch's order: ellipsis dims, then letters used once, sorted)."""
    equation = equation.replace(" ", "")
    inputs, arrow, output = equation.partition("->")
    terms = inputs.split(",")
    free = [c for c in string.ascii_letters if c not in equation]
    widest = max((rank - len(t.replace("...", "")) for t, rank in zip(terms, ranks) if "..." in t), default=0)
    ellipsis = "".join(free[:widest])
    expanded = [t.replace("...", ellipsis[widest - (rank - len(t.replace("...", ""))):])
                for t, rank in zip(terms, ranks)]
    if not arrow:
        letters = "".join(t.replace("...", "") for t in terms)
        output = "..." * ("..." in inputs) + "".join(sorted(c for c in set(letters) if letters.count(c) == 1))
    return ",".join(expanded) + "->" + output.replace("...", ellipsis)


def sublist_equation(args: tuple) -> str:
    """torch.einsum's sublist form (x, [0, 1], y, [1, 2], [0, 2]) as its equation ("ab,bc->ac"):
    ints 0..51 are letters, Ellipsis is "...", a trailing odd list is the output."""
    term = lambda sublist: "".join("..." if s is Ellipsis else string.ascii_letters[s] for s in sublist)  # noqa: E731
    inputs = ",".join(term(sublist) for sublist in args[1::2])
    return inputs + ("->" + term(args[-1]) if len(args) % 2 else "")


def _einsum_rule(call: Call, placements) -> Decision:
    given = call.args[0] if isinstance(call.args[0], str) else sublist_equation(call.args)
    equation = explicit_equation(given, [len(spec.shape) for spec in call.inputs])
    inputs, out = equation.split("->")
    terms = inputs.split(",")
    if len(terms) == 1 and set(terms[0]) <= set(out) and isinstance(placements[0], Partial):
        return Decision(placements, placements)   # a transpose or diagonal copies: any Partial passes
    _refuse_sharded_repeats(placements, terms)
    return einsum_decision(call, placements, equation)


def _refuse_sharded_repeats(placements, terms) -> None:
    for p, term in zip(placements, terms):
        if isinstance(p, Shard) and term.count(term[p.dim]) > 1:
            raise RuleRejected(f"letter {term[p.dim]!r} repeats in {term!r} (a diagonal) and is sharded",
                               "R on repeated letters; " + _LEGAL)


def _trace_rule(call: Call, placements) -> Decision:
    _refuse_sharded_repeats(placements, ["ii"])
    return einsum_decision(call, placements, "ii->")


# --- equations that depend on the inputs' ranks or arguments ---------------------------------------
_FREE = string.ascii_lowercase[:25]   # "z" is the contracted letter below


def _inner_equation(call: Call) -> str:
    """torch.inner: the last dims contract; a 0-d operand multiplies every element."""
    a, b = (len(spec.shape) for spec in call.inputs)
    if a == 0 or b == 0:
        left, right = _FREE[:a], _FREE[a:a + b]
        return f"{left},{right}->{left}{right}"
    left, right = _FREE[:a - 1], _FREE[a - 1:a + b - 2]
    return f"{left}z,{right}z->{left}{right}"


def _tensordot_equation(call: Call) -> str:
    """torch.tensordot(a, b, dims): dims=n contracts a's last n dims with b's first n; dims=(da, db)
    contracts da[i] of a with db[i] of b. The result: a's free dims, then b's."""
    a, b = (len(spec.shape) for spec in call.inputs)
    dims = call.param(2, "dims", 2)
    if isinstance(dims, int):
        pairs = [(a - dims + i, i) for i in range(dims)]
    else:
        first, second = ([d] if isinstance(d, int) else list(d) for d in dims)
        pairs = [(i % max(a, 1), j % max(b, 1)) for i, j in zip(first, second)]
    left = list(_FREE[:a])
    right = list(_FREE[a:a + b])
    for i, j in pairs:
        right[j] = left[i]
    contracted = {left[i] for i, _ in pairs}
    out = [c for c in left if c not in contracted] + [c for c in right if c not in contracted]
    return f"{''.join(left)},{''.join(right)}->{''.join(out)}"


def _cross_dim(call: Call) -> int:
    """torch.cross's dim (the first of size 3 when not given, as torch), in the result's dims."""
    ndim = len(call.out_shape)
    dim = call.param(2, "dim")
    if dim is None:
        dim = -1 if call.op == "linalg_cross" else list(call.out_shape).index(3)
    return dim % ndim


_CROSS_LEGAL = "S(d) off dim on either input (R sliced, broadcast dims R); one P(sum|avg) input with the other R"


def _cross_rule(call: Call, placements) -> Decision:
    partials = [p for p in placements if isinstance(p, Partial)]
    if partials:
        if len(partials) == 1 and partials[0].reduce_op in ("sum", "avg") and \
                all(p.is_replicate() for p in placements if p is not partials[0]):
            return Decision(placements, (partials[0],))   # bilinear: linear in each operand
        raise RuleRejected(f"cross is linear in each operand alone, not in ({', '.join(map(repr, placements))})",
                           _CROSS_LEGAL)
    decision = shard_decision(call, placements)
    (out,) = decision.outputs
    if isinstance(out, Shard) and out.dim == _cross_dim(call):
        raise RuleRejected(f"cross along sharded dim {out.dim}: each 3-vector's components live on different "
                           "ranks", _CROSS_LEGAL)
    return decision


def _cross_local(call: Call, required):
    """Without a dim torch picks the first of size 3, which on a shard may be another: name it."""
    if len(call.args) > 2 or call.kwargs.get("dim") is not None:
        return call.op, {}
    return call.op, {"dim": _cross_dim(call)}


# --- a product plus a term: linear's bias, baddbmm's input -----------------------------------------
def _term_placement(product: Decision, out_letters: str, term_letters: str, term_shape, out_shape, given):
    """The placement the added term needs next to the product's output placement."""
    out = product.outputs[0]
    if out.is_replicate() and isinstance(given, Partial) and given.reduce_op != "sum":
        return given      # R + P(avg|max|min): an average keeps the shift, max and min keep order
    if isinstance(out, Partial):
        if given == out or (out.reduce_op == "avg" and given.is_replicate()):
            return given
        raise RuleRejected(f"the product is {out!r}, so the added term must be {out!r} too "
                           f"(an R term would be added once per rank)", "the term with the product's Partial")
    if isinstance(out, Shard):
        letter = out_letters[out.dim]
        if letter in term_letters:
            dim = term_letters.index(letter)
            if term_shape[dim] == out_shape[out.dim] and (given.is_replicate() or given == Shard(dim)):
                return Shard(dim)
    if given.is_replicate():
        return given
    raise RuleRejected(f"the added term is {given!r} but the product is {out!r}",
                       "the term placed like the product (R, or S on the same letter)")


def _product_plus_term(product_equation, term_index: int):
    """A rule for `term + product(inputs)` where the term is tensor input `term_index`, if given."""
    def rule(call: Call, placements) -> Decision:
        equation = product_equation(call)
        has_term = len(call.inputs) > 2
        factors = [i for i in range(len(call.inputs)) if not (has_term and i == term_index)]
        product_call = call._replace(inputs=tuple([call.inputs[i] for i in factors]))
        product = einsum_decision(product_call, tuple([placements[i] for i in factors]), equation)
        if not has_term:
            return product
        out_letters = equation.split("->")[1]
        spec = call.inputs[term_index]
        term_letters = out_letters[len(out_letters) - len(spec.shape):] if spec.shape else ""
        given = placements[term_index]
        if call.kwargs.get("beta", 1) < 0 and isinstance(given, Partial) and given.reduce_op in ("max", "min"):
            raise RuleRejected(f"a term scaled by beta < 0 turns {given!r} around", _LEGAL)
        term = _term_placement(product, out_letters, term_letters, spec.shape, call.out_shape, given)
        required = list(product.inputs)
        required.insert(term_index, term)
        outputs = (term,) if isinstance(term, Partial) else product.outputs
        return Decision(tuple(required), outputs)
    return rule


def _linear_equation(call: Call) -> str:
    x, w = (len(call.inputs[i].shape) for i in (0, 1))
    batch = string.ascii_lowercase[:x - 1]
    return f"{batch}k,nk->{batch}n" if w == 2 else f"{batch}k,k->{batch}"


def _addmv(input, mat, vec, *, beta=1, alpha=1):
    """torch.addmv with `input` broadcast to the result first: torch returns input's own shape
    when the contraction is empty (a rank whose shard of vec is empty), and that rank's (1,) met
    the others' (n,) in the next collective, which hung."""
    return torch.addmv(input.expand(mat.shape[:1]), mat, vec, beta=beta, alpha=alpha)


MATRIX = {
    "matmul": OpRow(torch.matmul, einsum_rule(matmul_equation), doc="torch's rank cases as einsum equations"),
    "mm": OpRow(torch.mm, einsum_rule(lambda call: "xy,yz->xz"), doc="xy,yz->xz"),
    "bmm": OpRow(torch.bmm, einsum_rule(lambda call: "bxy,byz->bxz"), doc="bxy,byz->bxz"),
    "einsum": OpRow(torch.einsum, _einsum_rule, method=False,
                    doc="derived from the equation; a sharded repeated letter (diagonal) needs R"),
    "outer": OpRow(torch.outer, einsum_rule(lambda call: "x,y->xy"), doc="x,y->xy"),
    "linear": OpRow(torch.nn.functional.linear, _product_plus_term(_linear_equation, 2), method=False,
                    doc="...k,nk->...n plus bias placed like the result"),
    "baddbmm": OpRow(torch.baddbmm, _product_plus_term(lambda call: "bxy,byz->bxz", 0),
                     doc="bxy,byz->bxz plus input placed like the result"),
    # beta * input + alpha * product: the term placed like the product, as baddbmm's
    "addmm": OpRow(torch.addmm, _product_plus_term(lambda call: "xy,yz->xz", 0),
                   doc="xy,yz->xz plus input placed like the result"),
    "addmv": OpRow(_addmv, _product_plus_term(lambda call: "xy,y->x", 0),
                   doc="xy,y->x plus input placed like the result"),
    "addr": OpRow(torch.addr, _product_plus_term(lambda call: "x,y->xy", 0),
                  doc="x,y->xy plus input placed like the result"),
    "addbmm": OpRow(torch.addbmm, _product_plus_term(lambda call: "bxy,byz->xz", 0),
                    doc="bxy,byz->xz (the batch sums away) plus input placed like the result"),
    "mv": OpRow(torch.mv, einsum_rule(lambda call: "xy,y->x"), doc="xy,y->x"),
    "dot": OpRow(torch.dot, einsum_rule(lambda call: "y,y->"), doc="y,y->"),
    "vdot": OpRow(torch.vdot, einsum_rule(lambda call: "y,y->"), doc="y,y-> (the first conjugated)"),
    "inner": OpRow(torch.inner, einsum_rule(_inner_equation), doc="...z,...z->......: the last dims contract"),
    "tensordot": OpRow(torch.tensordot, einsum_rule(_tensordot_equation), method=False,
                       doc="the contracted dims as shared einsum letters"),
    "trace": OpRow(torch.trace, _trace_rule, doc="ii->: R or P(sum|avg) (a sharded diagonal is refused)"),
    "cross": OpRow(torch.cross, _cross_rule, local=_cross_local, doc=_CROSS_LEGAL),
    "linalg_cross": OpRow(torch.linalg.cross, _cross_rule, method=False, doc=_CROSS_LEGAL + " (dim=-1 by default)"),
}
register_family("matrix", MATRIX)

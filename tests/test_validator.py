"""The rule validator (python -m dtorch.ops.tooling.validate): it must find no wrong rule in the op
tables, must catch a planted wrong rule and a planted over-strict one, and must run as a module.
It simulates ranks on this CPU: no worker processes here."""
import os
import subprocess
import sys

import pytest
import torch

import dtorch.ops  # noqa: F401  (registers the families)
from dtorch.spec.placements import DeviceMesh, Partial, Replicate, Shard
from dtorch.ops.registry import REGISTRY, RegisteredOp
from dtorch.ops.rules import Decision, R, RuleRejected
from dtorch.ops.tooling.samples import SAMPLED_FAMILIES
from dtorch.ops.tooling.simulate import contributions, matches
from dtorch.ops.tooling.validate import validate

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Every op of the sampled families, exhaustively on a 3-way mesh with uneven shapes. The biggest
# ones (attention: 4 inputs of 4 dims) get a seeded sample of their combinations.
OPS = sorted(name for name, spec in REGISTRY.items() if spec.family in SAMPLED_FAMILIES)


@pytest.mark.parametrize("op", OPS)
def test_no_rule_is_wrong_or_missing(op):
    stats, findings = validate(op, (3,), uneven=True, limit=400)
    assert stats.accepted > 0
    problems = [str(f) for f in findings if f.kind in ("WRONG", "MISSING")]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("op", ["add", "where", "matmul", "sum"])
def test_no_wrong_rule_on_a_two_dim_mesh(op):
    # (2, 3): extents differ, so no identity that holds only for square meshes can pass as a rule
    stats, findings = validate(op, (2, 3), uneven=True, limit=300)
    assert not [str(f) for f in findings if f.kind == "WRONG"]


def test_a_wrong_rule_is_reported():
    lenient = RegisteredOp("exp", torch.exp, lambda call, placements: Decision(placements, placements), "test")
    stats, findings = validate(lenient, (3,))
    wrong = {f.placements for f in findings if f.kind == "WRONG"}
    assert ((Partial("sum"),),) in wrong and ((Partial("avg"),),) in wrong
    assert ((Shard(0),),) not in wrong and ((Partial("max"),),) not in wrong   # exp keeps order


def test_a_missing_rule_is_reported_with_the_placement_that_works():
    def replicate_only(call, placements):
        if any(not p.is_replicate() for p in placements):
            raise RuleRejected("only R", "R")
        return Decision(placements, (R,))
    strict = RegisteredOp("add", torch.add, replicate_only, "test")
    stats, findings = validate(strict, (3,))
    missing = {f.placements: f.detail for f in findings if f.kind == "MISSING"}
    assert "[S(0)]" in missing[((Shard(0),), (Shard(0),))]
    assert "[P(sum)]" in missing[((Partial("sum"),), (Partial("sum"),))]
    assert ((Shard(0),), (Shard(1),)) not in missing


def test_declined_findings_carry_their_reason():
    stats, findings = validate("mul", (3,))
    declined = [f for f in findings if f.kind == "DECLINED"]
    assert declined and all("scalar" in f.detail for f in declined)


@pytest.mark.parametrize("placements", [(Partial("sum"), Partial("max")), (Partial("min"), Replicate()),
                                        (Replicate(), Partial("avg"))])
def test_contributions_reduce_back_to_the_value(placements):
    mesh = DeviceMesh("cpu", [[0, 1, 2], [3, 4, 5]])
    value = torch.randn(4, 5, dtype=torch.float64)
    held = contributions(value, mesh, placements, torch.Generator().manual_seed(0))
    assert matches(held, mesh, placements, value)
    assert not matches(held, mesh, (Replicate(), Replicate()), value)


def test_command_line():
    run = subprocess.run([sys.executable, "-m", "dtorch.ops.tooling.validate", "--op", "add", "--op", "neg"],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "add: " in run.stdout and "0 wrong" in run.stdout and "2 op(s) on mesh (3,)" in run.stdout
    bad = subprocess.run([sys.executable, "-m", "dtorch.ops.tooling.validate", "--op", "no_such_op"],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "no_such_op" in bad.stderr


@pytest.mark.timeout(300)   # plans every placement combination of every op: ~20 s (meta inference once per shape)
def test_docs_ops_md_is_generated_from_the_tables():
    from dtorch.ops.tooling.docs import render
    with open(os.path.join(REPO, "docs", "reference", "ops.md")) as f:
        assert f.read() == render(), ("docs/reference/ops.md is stale: "
                                      "python -m dtorch.ops.tooling.docs > docs/reference/ops.md")


def test_every_op_of_the_swept_families_has_samples():
    from dtorch.ops.tooling.samples import covered_ops
    assert not set(OPS) - covered_ops(), "add a sample call in its family's dtorch/ops/tooling/<family>_samples.py"

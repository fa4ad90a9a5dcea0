"""Bad input gets a clear error at the user's line; a worker-side failure comes back at the next
read of a result that depends on it, and everything else keeps working."""
import inspect
import warnings

import pytest
import torch

import dtorch
from dtorch.spec.placements import Partial, Replicate, Shard, init_device_mesh
from dtorch.errors import DependencyError, MeshError, PlacementError, RemoteError, ShapeError


def test_shape_mismatch_is_raised_on_the_controller(mesh4):
    x = dtorch.zeros(8, 4, device_mesh=mesh4, placements=[Shard(0)])
    y = dtorch.zeros(8, 5, device_mesh=mesh4, placements=[Shard(0)])
    with pytest.raises(ShapeError) as info:
        x + y
    assert "add" in str(info.value) and "(8, 4)" in str(info.value) and "test_errors.py" in str(info.value)


def test_tensors_on_different_meshes(mesh4, mesh22):
    x = dtorch.zeros(8, device_mesh=mesh4, placements=[Shard(0)])
    y = dtorch.zeros(8, device_mesh=mesh22, placements=[Shard(0), Replicate()])
    with pytest.raises(MeshError, match="different meshes"):
        x + y


def test_unsupported_placement_names_op_placements_mesh_and_fix(mesh22, strict):
    x = dtorch.zeros(8, 8, device_mesh=mesh22, placements=[Shard(0), Partial()])
    y = dtorch.zeros(8, 8, device_mesh=mesh22, placements=[Shard(0), Replicate()])
    with pytest.raises(PlacementError) as info:
        x + y
    message = str(info.value)
    for expected in ("add", "[S(0), P(sum)]", "'tp'", "DeviceMesh", "Legal there", "redistribute", "test_errors.py"):
        assert expected in message, (expected, message)


def test_bad_placements_at_creation(mesh4):
    with pytest.raises(PlacementError, match="one placement per mesh dim"):
        dtorch.zeros(4, device_mesh=mesh4, placements=[Shard(0), Shard(0)])
    with pytest.raises(PlacementError, match="outside"):
        dtorch.zeros(4, device_mesh=mesh4, placements=[Shard(1)])


def _failing_division(mesh):
    """Integer floor division by zero fails inside the worker that holds the zero (rank 3)."""
    numerator = dtorch.tensor(torch.arange(8), device_mesh=mesh, placements=[Shard(0)])
    denominator = dtorch.tensor(torch.tensor([1, 1, 1, 1, 1, 1, 0, 1]), device_mesh=mesh, placements=[Shard(0)])
    return numerator, dtorch.div(numerator, denominator, rounding_mode="floor")  # line of the failing op


def test_moving_a_failed_result_to_a_mesh_without_the_failed_rank_still_raises(mesh4, mesh1):
    _, quotient = _failing_division(mesh4)           # fails on rank 3; mesh1 is rank 0 alone
    moved = quotient.redistribute(device_mesh=mesh1, placements=[Replicate()])
    with pytest.raises(DependencyError, match="div"):
        moved.to_torch()
    shifted = quotient * 1
    with pytest.raises(DependencyError):
        shifted.redistribute(placements=[Replicate()]).redistribute(device_mesh=mesh1,
                                                                    placements=[Replicate()]).to_torch()


def test_worker_exception_surfaces_at_the_read_with_rank_and_user_line(mesh4):
    numerator, quotient = _failing_division(mesh4)
    dependent = quotient + 1
    independent = numerator * 2
    assert torch.equal(independent.to_torch(), torch.arange(8) * 2)   # unaffected results still read
    with pytest.raises(RemoteError) as info:
        quotient.to_torch()
    error = info.value
    assert not isinstance(error, DependencyError)
    assert error.op == "div" and error.ranks == [3] and "ZeroDivisionError" in str(error)
    assert "test_errors.py" in error.user_site and "Traceback" in error.remote_traceback
    with pytest.raises(DependencyError, match="depends on a command that failed"):
        dependent.to_torch()
    # a collective over a poisoned input: every rank agrees, nobody hangs, the read raises
    with pytest.raises(DependencyError):
        quotient.redistribute(placements=[Replicate()]).to_torch()
    assert torch.equal((numerator + 1).to_torch(), torch.arange(8) + 1)  # the session goes on


# --- a read names the first failure of its chain (Monarch's "depends on error") ------------------
def test_a_read_names_the_first_failure_not_the_collective_that_failed_after_it(mesh4):
    """The matmul fails on every rank (torch has no uint64 matmul on CPU). Reading its P(sum)
    result runs a P(sum) -> R whose all-reduce fails too, with zeros standing in for the failed
    input (Gloo reduces no uint64): the read names the matmul, and that second failure, which
    only followed from it, is never reported."""
    x = dtorch.tensor(torch.ones(4, 8, dtype=torch.uint64), device_mesh=mesh4, placements=[Shard(1)])
    y = dtorch.tensor(torch.ones(8, 3, dtype=torch.uint64), device_mesh=mesh4, placements=[Shard(0)])
    product = x @ y
    assert product.placements == (Partial(),)
    for read in (product, product * 2):
        with pytest.raises(DependencyError) as info:
            read.to_torch()
        assert (info.value.op, info.value.seq) == ("matmul", product._seq), str(info.value)
    dtorch.synchronize(timeout=30)   # nothing else failed


def test_a_move_to_another_mesh_names_the_earliest_failure_of_its_ranks(mesh4, mesh1):
    """z fails on rank 3 (the div, first) and on rank 1 (the remainder, after it). A read of z
    names the div, and so must a read of z moved to rank 0 alone, where the ranks of the move
    agree on one failure for it: the earliest."""
    numerator, quotient = _failing_division(mesh4)   # rank 3
    divisor = dtorch.tensor(torch.tensor([1, 1, 0, 1, 1, 1, 1, 1]), device_mesh=mesh4, placements=[Shard(0)])
    rest = dtorch.remainder(numerator, divisor)       # rank 1: an integer remainder by zero
    z = quotient + rest
    for read in (z, z.redistribute(device_mesh=mesh1, placements=[Replicate()])):
        with pytest.raises(DependencyError) as info:
            read.to_torch()
        assert (info.value.op, info.value.seq) == ("div", quotient._seq), str(info.value)
    with pytest.raises(RemoteError, match="remainder"):
        rest.to_torch()


def test_a_stand_in_that_fails_too_keeps_its_inputs_failure(monkeypatch):
    """Two in-process workers (tests/test_redistribute_failures.py): rank 1's input fails (the
    factory, command #1), and then so does the first step of the zeros that stand in for it in
    the redistribute's collectives. Its output still carries the factory's failure, and the
    stand-in's is not reported: it follows from the first."""
    from dtorch.runtime.worker import kernels, worker as worker_module
    from test_redistribute_failures import COMMANDS, fail_on, run_on_two_ranks
    fail_on(monkeypatch, worker_module, "make_factory")
    fail_on(monkeypatch, kernels, "_pad_to")
    healthy, failed = run_on_two_ranks(COMMANDS)
    assert failed.shards.poisoned.get(2) == 1 and 2 not in failed.tensors
    assert [header[2] for header in failed.sockets.sent] == [1]   # one report: the factory's
    assert 2 in healthy.tensors and not healthy.sockets.sent


def _warnings_of(issue, repeats: int = 1) -> tuple[list, int]:
    """The warnings shown while `issue` runs `repeats` times and its last result is read (with
    every warning shown, repeats included), and the line of `issue` that made them."""
    dtorch.synchronize()   # an earlier test's warnings are shown by now
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(repeats):
            result = issue()
        result.to_torch()
    return caught, inspect.getsourcelines(issue)[1]


def test_a_workers_warning_is_shown_once_at_the_users_line_not_once_per_rank(mesh4):
    z = dtorch.randn(4, 5, device_mesh=mesh4, placements=[Shard(0)])
    caught, line = _warnings_of(lambda: z.std(1, correction=5))   # every rank: degrees of freedom <= 0
    assert len(caught) == 1, [str(w.message) for w in caught]
    shown = caught[0]
    assert shown.category is UserWarning and shown.filename == __file__ and shown.lineno == line
    assert str(shown.message).startswith("std (on the workers): ") and "degrees of freedom" in str(shown.message)
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # the same op in plain torch warns alike
        with pytest.raises(UserWarning, match="degrees of freedom"):
            torch.randn(4, 5).std(1, correction=5)


def test_every_command_that_warns_is_shown_and_the_session_goes_on(mesh4):
    z = dtorch.randn(4, 5, device_mesh=mesh4, placements=[Shard(0)])
    caught, line = _warnings_of(lambda: z.std(1, correction=5), repeats=3)
    assert [w.lineno for w in caught] == [line] * 3   # one per command, whichever ranks raised it
    quiet, _ = _warnings_of(lambda: z.std(1))
    assert quiet == []
    assert torch.equal((z * 0).to_torch(), torch.zeros(4, 5))


def test_an_empty_shards_warning_is_not_the_ops(mesh4):
    """3 rows on 4 ranks: rank 3's shard has none, and std over its columns warns there alone;
    torch on the whole (3, 5) tensor does not."""
    values = torch.randn(3, 5)
    x = dtorch.tensor(values, device_mesh=mesh4, placements=[Shard(0)])
    caught, _ = _warnings_of(lambda: x.std(1))
    assert caught == [], [str(w.message) for w in caught]
    assert torch.allclose(x.std(1).to_torch(), values.std(1))


def test_a_warning_inside_a_compiled_function_names_its_line_there(mesh4):
    def spread(z):
        return z.std(1, correction=5) + 1   # warns on every rank, in every replay

    compiled = dtorch.compile(spread)
    z = dtorch.randn(4, 5, device_mesh=mesh4, placements=[Shard(0)])
    with pytest.warns(UserWarning, match="degrees of freedom"):
        compiled(z).to_torch()   # the capture runs it eagerly, and warns as eager does
    caught, _ = _warnings_of(lambda: compiled(z))
    assert compiled.captures == 1 and len(caught) == 1, [str(w.message) for w in caught]
    assert caught[0].filename == __file__ and caught[0].lineno == inspect.getsourcelines(spread)[1] + 1


def test_a_warning_the_filters_make_an_error_fails_the_op_at_its_read(mesh4):
    """As under `python -W error` in plain torch the op raises, so here its result's read does,
    and synchronize() raises it if nothing read it; the session goes on."""
    z = dtorch.randn(4, 5, device_mesh=mesh4, placements=[Shard(0)])
    dtorch.synchronize()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", category=UserWarning)
        line = inspect.currentframe().f_lineno + 1
        spread = z.std(1, correction=5)   # every rank warns: degrees of freedom <= 0
        with pytest.raises(RemoteError) as info:
            spread.to_torch()
        unread = z.std(1, correction=6)
        with pytest.raises(RemoteError, match="degrees of freedom"):
            dtorch.synchronize()
        assert torch.equal((z * 0).to_torch(), torch.zeros(4, 5))   # no warning: reads as usual
    error = info.value
    assert error.op == "std" and error.exception_type == "UserWarning" and "degrees of freedom" in str(error)
    assert error.user_site == f"{__file__}:{line}"
    del unread


def test_a_remote_error_names_the_exact_line_even_deep_in_a_long_function(mesh4, tmp_path):
    """Each command's place is kept as (code, instruction offset), and its line worked out only
    for an error: the line named is the one that issued the op, 300 lines into a function and
    on the second line of a statement, as f_lineno would give it."""
    filler = "".join(f"    x{i} = {i}\n" for i in range(300))
    source = ("import dtorch\n"
              "def program(numerator, denominator):\n" + filler +
              "    quotient = (numerator +\n"
              "                dtorch.div(numerator, denominator, rounding_mode='floor'))\n"
              "    return quotient\n")
    path = tmp_path / "long_program.py"
    path.write_text(source)
    namespace = {}
    exec(compile(source, str(path), "exec"), namespace)
    numerator = dtorch.tensor(torch.arange(8), device_mesh=mesh4, placements=[Shard(0)])
    denominator = dtorch.tensor(torch.tensor([1, 1, 1, 1, 1, 1, 0, 1]), device_mesh=mesh4, placements=[Shard(0)])
    quotient = namespace["program"](numerator, denominator)
    with pytest.raises(DependencyError) as info:
        quotient.to_torch()
    div_line = source.splitlines().index("                dtorch.div(numerator, denominator, "
                                         "rounding_mode='floor'))") + 1
    assert f"{path}:{div_line}" in str(info.value), str(info.value)


def test_synchronize_raises_failures_no_read_has_raised(mesh4):
    _failing_division(mesh4)
    with pytest.raises(RemoteError, match="div"):
        dtorch.synchronize(timeout=30)
    dtorch.synchronize(timeout=30)  # reported once, then cleared


def test_mesh_shape_must_be_positive(session):
    with pytest.raises(MeshError, match="positive"):
        init_device_mesh("cpu", (0,))


def test_version_mismatch_is_refused_with_a_reason(session):
    import zmq
    from dtorch.runtime import protocol
    from dtorch.runtime.controller import session as runtime_session
    controller = runtime_session.controller()
    context = zmq.Context()
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.IDENTITY, b"w99")
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(controller.sockets.reply_address)
    try:
        dealer.send_multipart([protocol.pack((99, int(protocol.Kind.REGISTER), 99, "h", 1, "cpu"))])
        assert dealer.poll(5000), "no answer to a bad registration"
        fields = protocol.unpack(dealer.recv_multipart()[0])
        assert fields[1] == protocol.Kind.REFUSED and "version" in fields[2]
    finally:
        context.destroy(linger=0)



def test_an_error_report_that_overtakes_the_publish_call_still_reaches_the_read(mesh4, monkeypatch):
    """A worker can run a batch and report its failure before the thread that published the batch
    returns from the send (CI saw it: a read of a failed replay hung). The report must count as
    one for a command that was sent."""
    import time
    from dtorch.runtime.controller import session as runtime_session
    controller = runtime_session.controller()
    dtorch.synchronize()
    send = controller.sockets.publish

    def slow_to_return(frames, copy=True):
        send(frames, copy)
        time.sleep(0.2)   # the workers run the batch and report meanwhile
    monkeypatch.setattr(controller.sockets, "publish", slow_to_return)
    # the read's own thread publishes it all: no idle-flush timer runs
    monkeypatch.setattr(controller, "_flush_soon", lambda: None)
    monkeypatch.setattr(controller, "_flush_if_idle", lambda: None)
    rejected = dtorch.stats()["messages_rejected"]
    _, quotient = _failing_division(mesh4)
    with pytest.raises(RemoteError, match="div"):
        quotient.fetch().result(timeout=30)
    monkeypatch.undo()
    controller._flush_scheduled = False   # the timer this test kept from running is not armed
    assert dtorch.stats()["messages_rejected"] == rejected


def test_a_result_whose_dtype_torchs_meta_kernel_gets_wrong_names_the_op_at_the_read(mesh4):
    """torch 2.13's meta kernel says bool ** True is int64, its CPU kernel gives bool: the read
    cannot fit the bytes, and the error names the op and line that made the tensor, not only a
    byte count. The session goes on."""
    probe = torch.tensor([True])
    if (probe.to("meta") ** True).dtype == (probe ** True).dtype:
        pytest.skip("this torch's meta and CPU kernels agree on bool ** True")
    x = dtorch.tensor(torch.tensor([True, False, True, True]), device_mesh=mesh4, placements=[Shard(0)])
    with pytest.raises(dtorch.errors.ProtocolError, match=r"made by command #\d+ \(pow, issued at .*test_errors.py"):
        (x ** True).to_torch()
    assert torch.equal((x.float() + 1).to_torch(), torch.tensor([2.0, 1.0, 2.0, 2.0]))


@pytest.mark.parametrize("op", ["matmul", "linear", "addmm", "conv1d", "layer_norm"])
def test_two_dtypes_where_torchs_kernels_take_one_are_refused_at_the_users_line(mesh4, op):
    """torch's meta kernels type mm(float32, bfloat16) as float32, its CPU and CUDA kernels
    refuse it: the workers failed at the next read. A lower-precision input with float32 norm
    parameters is torch's mixed-precision norm, and stays allowed."""
    a = dtorch.randn(4, 4, device_mesh=mesh4, placements=[Shard(0)])
    b = dtorch.randn(4, 4, device_mesh=mesh4, placements=[Replicate()], dtype=torch.bfloat16)
    calls = {"matmul": lambda: a @ b, "linear": lambda: torch.nn.functional.linear(a, b),
             "addmm": lambda: torch.addmm(a, a, b), "layer_norm": lambda: torch.nn.functional.layer_norm(a, (4,), b[0]),
             "conv1d": lambda: torch.nn.functional.conv1d(a.unsqueeze(0), b.unsqueeze(-1))}
    with pytest.raises(ShapeError, match=rf"{op}: inputs of two dtypes \(bfloat16 and float32\) at .*test_errors.py:"):
        calls[op]()
    mixed_norm = torch.nn.functional.layer_norm(b, (4,), a[0])   # bf16 input, float32 weight: torch's rule
    torch.testing.assert_close(mixed_norm.to_torch(),
                               torch.nn.functional.layer_norm(b.to_torch(), (4,), a[0].to_torch()))


def test_in_place_forms_of_composed_methods_and_from_local_say_what_to_write(mesh4):
    x = dtorch.randn(4, 4, device_mesh=mesh4, placements=[Shard(0)])
    assert x.t_() is x and x.placements == (Shard(1),)   # in place, as torch (docs/reference/inplace.md)
    assert x.swapaxes_(0, 1) is x and x.placements == (Shard(0),)
    with pytest.raises(dtorch.UnsupportedOpError, match=r"x.set_ .* Write x.data = source"):
        x.set_(x * 2)
    with pytest.raises(dtorch.UnsupportedOpError, match=r"DTensor.from_local .* dtorch.distribute_tensor\(t, mesh"):
        dtorch.DTensor.from_local(torch.ones(2), mesh4, [Shard(0)])

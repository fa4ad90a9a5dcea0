"""dtorch.replace_lost_workers: a worker killed mid-run is replaced in the same controller process,
keeping its rank; meshes that named it work again, tensors that lived on it are refused with
LostTensorError, tensors of survivors-only meshes stay valid; a training loop with checkpoints
goes on after the reload exactly as an uninterrupted run. Each test runs its own session in a
subprocess (tests/support.py run_script) and checks that no worker outlives it."""
import json
import time

from support import alive, run_script


def _report(result) -> dict:
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def _all_ended(pids) -> None:
    deadline = time.monotonic() + 10
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in pids if alive(p)], "workers outlived their session"


def test_a_killed_worker_is_replaced_and_its_mesh_works_again():
    report = _report(run_script("""
        import json, os, signal, time, torch, dtorch
        from dtorch.spec.placements import init_device_mesh, Replicate, Shard
        mesh = init_device_mesh("cpu", (2,))
        solo = init_device_mesh("cpu", (1,))            # rank 0 only: survives rank 1's loss
        kept = dtorch.tensor(torch.arange(6.0), device_mesh=solo, placements=[Replicate()])
        x = dtorch.ones(8, 4, device_mesh=mesh, placements=[Shard(0)])
        assert x.sum().item() == 32
        pids = [w["pid"] for w in dtorch.workers()]
        os.kill(pids[1], signal.SIGKILL)
        try:
            (x * 2).to_torch()
            lost = None
        except dtorch.WorkerLostError as error:
            lost = str(error)
        start = time.monotonic()
        replaced = dtorch.replace_lost_workers(timeout=60)
        seconds = time.monotonic() - start
        refusals = []
        for attempt in (lambda: x.to_torch(), lambda: x + 1, lambda: x.redistribute(mesh, [Replicate()])):
            try:
                attempt()
                refusals.append(None)
            except dtorch.LostTensorError as error:
                refusals.append(str(error))
        g = torch.Generator().manual_seed(0)
        a, b = torch.randn(8, 4, generator=g), torch.randn(4, 3, generator=g)
        y = dtorch.tensor(a, device_mesh=mesh, placements=[Shard(0)])
        w = dtorch.tensor(b, device_mesh=mesh, placements=[Replicate()])
        checks = {
            "matmul": torch.equal((y @ w).to_torch(), a @ b),
            "all_gather": torch.equal(y.redistribute(mesh, [Replicate()]).to_torch(), a),
            "all_reduce": torch.allclose(y.sum().to_torch(), a.sum(), atol=1e-6),
            "survivor_tensor": torch.equal(kept.to_torch(), torch.arange(6.0)),
            "transfer_from_survivor_mesh": torch.equal(kept.redistribute(mesh, [Shard(0)]).to_torch(),
                                                       torch.arange(6.0)),
        }
        dtorch.synchronize()   # the survivor's collective that broke with the loss is not raised again
        pids += [r["pid"] for r in replaced]
        print(json.dumps({"lost": lost, "replaced": replaced, "old_pids": pids[:2], "seconds": seconds,
                          "refusals": refusals, "checks": checks, "pids": pids}))
    """, timeout=120))
    assert report["lost"] and "rank 1" in report["lost"]
    [replaced] = report["replaced"]
    assert replaced["rank"] == 1 and replaced["lost_pid"] == report["old_pids"][1]
    assert replaced["pid"] not in report["old_pids"]
    assert report["seconds"] < 30, report
    for refusal in report["refusals"]:
        assert refusal and "rank 1" in refusal and "replace_lost_workers" in refusal and "Rebuild it" in refusal
        assert refusal.startswith("at <string>:")   # the user's own line (run_script runs python -c)
    assert all(report["checks"].values()), report["checks"]
    _all_ended(report["pids"])


def test_nothing_lost_is_a_no_op_and_later_losses_are_recovered_too():
    report = _report(run_script("""
        import json, os, signal, torch, dtorch
        from dtorch.spec.placements import init_device_mesh, Replicate, Shard
        mesh = init_device_mesh("cpu", (2,))
        before = [w["pid"] for w in dtorch.workers()]
        noop = dtorch.replace_lost_workers()
        same = [w["pid"] for w in dtorch.workers()] == before
        pids, sums = list(before), []
        for victim in (1, 1, 0):   # the replacement itself, then the other rank
            x = dtorch.arange(12.0, device_mesh=mesh, placements=[Shard(0)])
            assert x.sum().item() == 66
            os.kill(dtorch.workers()[victim]["pid"], signal.SIGKILL)
            try:
                x.redistribute(mesh, [Replicate()]).to_torch()
            except dtorch.WorkerLostError:
                pass
            [replaced] = dtorch.replace_lost_workers(timeout=60)
            assert replaced["rank"] == victim
            pids.append(replaced["pid"])
            y = dtorch.arange(12.0, device_mesh=mesh, placements=[Shard(0)])
            sums.append(y.redistribute(mesh, [Replicate()]).sum().item())
        for worker in dtorch.workers():   # every worker at once: no survivor to wait for
            os.kill(worker["pid"], signal.SIGKILL)
        try:
            y.sum().item()
        except dtorch.WorkerLostError:
            pass
        replaced = dtorch.replace_lost_workers(timeout=60)
        pids += [r["pid"] for r in replaced]
        y = dtorch.arange(12.0, device_mesh=mesh, placements=[Shard(0)])
        sums.append(y.redistribute(mesh, [Replicate()]).sum().item())
        print(json.dumps({"noop": noop, "same": same, "sums": sums, "pids": pids,
                          "all_lost": sorted(r["rank"] for r in replaced)}))
    """, timeout=150))
    assert report["noop"] == [] and report["same"]
    assert report["sums"] == [66.0] * 4
    assert report["all_lost"] == [0, 1]
    assert len(set(report["pids"])) == len(report["pids"]) == 7
    _all_ended(report["pids"])


TRAINING = """
    import json, os, signal, torch, dtorch
    from dtorch.spec.placements import init_device_mesh, Replicate, Shard
    mesh = init_device_mesh("cpu", (2,))
    g = torch.Generator().manual_seed(0)
    X = torch.randn(64, 8, generator=g, dtype=torch.float64)
    Y = (X @ torch.randn(8, 1, generator=g, dtype=torch.float64)
         + 0.1 * torch.randn(64, 1, generator=g, dtype=torch.float64))
    STEPS, EVERY, LR = 12, 3, 0.05

    def upload(value, placement):
        return dtorch.tensor(value, device_mesh=mesh, placements=[placement])

    def train(kill_at=None):
        # linear regression with explicit gradients: x batch-sharded S(0), w Replicate
        x, y, w = upload(X, Shard(0)), upload(Y, Shard(0)), upload(torch.zeros(8, 1, dtype=torch.float64), Replicate())
        losses, checkpoint, step, reload_step = {}, (0, torch.zeros(8, 1, dtype=torch.float64)), 0, None
        while step < STEPS:
            if step % EVERY == 0:
                checkpoint = (step, w.to_torch())
            if step == kill_at:
                kill_at = None
                os.kill(dtorch.workers()[1]["pid"], signal.SIGKILL)
            try:
                err = x @ w - y
                loss = (err * err).mean()
                grad = (x.T @ err).redistribute(mesh, [Replicate()]) * (2.0 / X.shape[0])
                w = w - LR * grad
                losses[step] = loss.item()
                step += 1
            except dtorch.WorkerLostError:
                dtorch.replace_lost_workers(timeout=60)
                step, saved = checkpoint
                reload_step = step
                x, y, w = upload(X, Shard(0)), upload(Y, Shard(0)), upload(saved, Replicate())
        return losses, reload_step

    clean, _ = train()
    recovered, reload_step = train(kill_at=7)
    print(json.dumps({"clean": clean, "recovered": recovered, "reload_step": reload_step,
                      "pids": [w["pid"] for w in dtorch.workers()]}))
"""


def test_training_killed_mid_run_resumes_from_its_checkpoint_with_the_same_losses():
    report = _report(run_script(TRAINING, timeout=150))
    clean, recovered = report["clean"], report["recovered"]
    assert report["reload_step"] == 6
    assert sorted(recovered, key=int) == sorted(clean, key=int) and len(clean) == 12
    after = [s for s in clean if int(s) >= report["reload_step"]]
    for step in after:
        assert abs(recovered[step] - clean[step]) <= 1e-6, (step, recovered[step], clean[step])
    assert clean["11"] < clean["0"] / 2   # it does train
    print("losses after the reload (step, clean, recovered):",
          [(int(s), clean[s], recovered[s]) for s in sorted(after, key=int)])
    _all_ended(report["pids"])


def test_groups_of_a_new_generation_get_new_names_and_drop_only_replaced_ranks():
    from dtorch.runtime.devices.comm import GlooCommunicator, group_name
    assert group_name((0, 1), 0) == "0-1"          # no recovery yet: the names as before
    assert group_name((0, 1), 2) == "g2/0-1"
    comm = GlooCommunicator.__new__(GlooCommunicator)   # no store: regroup only edits the caches
    comm._groups, comm._broken, comm._abandoned, comm.generation = {(0, 1): "a", (0, 2): "b"}, {(1, 2): "gone"}, [], 0
    comm.regroup(1, (1,))
    assert comm.generation == 1 and list(comm._groups) == [(0, 2)] and comm._broken == {}
    assert comm._abandoned == [("a", None)]   # kept, never destroyed


def test_the_worker_regroups_its_communicator_and_its_host_channel_once_each():
    from dtorch.runtime import protocol as wire
    from dtorch.runtime.devices.device import CpuDevice
    from dtorch.runtime.worker.worker import Worker

    class Recording:
        def __init__(self):
            self.calls = []

        def regroup(self, generation, replaced):
            self.calls.append((generation, replaced))
    comm, host = Recording(), Recording()
    Worker(0, None, comm, CpuDevice(), 0, host).handle_regroup(wire.Regroup(5, 3, (1, 2)))
    assert comm.calls == host.calls == [(3, (1, 2))]
    same = Recording()
    Worker(0, None, same, CpuDevice(), 0).handle_regroup(wire.Regroup(5, 3, (1,)))
    assert same.calls == [(3, (1,))]


def test_a_survivors_late_reply_to_a_read_the_loss_failed_is_not_a_protocol_error():
    """The read fails with WorkerLostError at once; the survivor answers it a second later, busy
    until then: that reply is expected, so nothing is logged as a dropped message."""
    result = run_script("""
        import json, os, signal, dtorch
        from dtorch.spec.placements import init_device_mesh, Replicate, Shard
        mesh = init_device_mesh("cpu", (2,))
        x = dtorch.ones(8, 4, device_mesh=mesh, placements=[Shard(0)])
        big = dtorch.ones(1500, 1500, device_mesh=init_device_mesh("cpu", (1,)), placements=[Replicate()])
        assert x.sum().item() == 32
        pids = [w["pid"] for w in dtorch.workers()]
        os.kill(pids[1], signal.SIGKILL)
        for _ in range(8):
            big = (big @ big) / 1500       # rank 0 busy for a while
        try:
            (x * 2).to_torch()
            lost = None
        except dtorch.WorkerLostError as error:
            lost = str(error)
        big.to_torch()                     # rank 0 has answered the failed read by now
        print(json.dumps({"lost": lost, "rejected": dtorch.stats().get("messages_rejected"), "pids": pids}))
    """, timeout=120)
    report = _report(result)
    assert report["lost"] and "rank 1" in report["lost"]
    assert "does not owe" not in result.stderr and "dropped a message" not in result.stderr, result.stderr
    assert not report["rejected"], report
    _all_ended(report["pids"])

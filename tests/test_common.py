"""nanoagent/common.py: single-process setup, and a real 2-process torchrun run on CPU with gloo."""

import os
import random
import subprocess
import sys
import textwrap

import torch

from nanoagent.common import compute_cleanup, compute_init, get_dist_info, rng_state, seed_everything, set_rng_state


def test_single_process_without_torchrun(monkeypatch):
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    assert get_dist_info() == (False, 0, 0, 1)
    ddp, rank, local_rank, world_size, device = compute_init("cpu")
    assert (ddp, rank, local_rank, world_size, device.type) == (False, 0, 0, 1, "cpu")
    compute_cleanup()


def test_seeding_differs_per_rank_and_repeats():
    seed_everything(7, rank=0)
    a = torch.rand(3)
    seed_everything(7, rank=1)
    b = torch.rand(3)
    seed_everything(7, rank=0)
    assert torch.equal(a, torch.rand(3)) and not torch.equal(a, b)


def test_restored_rng_state_draws_the_same_numbers_again():
    state = rng_state()
    first = (random.random(), torch.rand(3))
    set_rng_state(state)
    assert random.random() == first[0] and torch.equal(torch.rand(3), first[1])


def on_two_ranks(tmp_path, source):
    """Run a script's source under torchrun with 2 CPU processes (gloo); its stdout, once it succeeded."""
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(source))
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=repo, OMP_NUM_THREADS="1")
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script)],
        capture_output=True, text=True, env=env, timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def test_torchrun_two_processes_gloo_all_reduce(tmp_path):
    output = on_two_ranks(tmp_path, """
        import torch, torch.distributed as dist
        from nanoagent.common import compute_init, compute_cleanup
        ddp, rank, local_rank, world_size, device = compute_init("cpu")
        assert ddp and world_size == 2 and dist.get_backend() == "gloo"
        value = torch.tensor([float(rank + 1)])  # rank 0 holds 1, rank 1 holds 2
        dist.all_reduce(value)
        print(f"rank {rank} sum {value.item()}", flush=True)
        compute_cleanup()
    """)
    assert "rank 0 sum 3.0" in output and "rank 1 sum 3.0" in output, output


def test_a_rank_left_waiting_in_a_collective_stops_with_an_error_at_the_time_out(tmp_path):
    # A rank that makes a collective the others never make (a divergence) raises after compute_init's time-out,
    # naming the call in its traceback, instead of waiting forever.
    output = on_two_ranks(tmp_path, """
        import os, time, torch, torch.distributed as dist
        from nanoagent.common import compute_init
        ddp, rank, local_rank, world_size, device = compute_init("cpu", timeout_minutes=0.05)  # 3 s
        if rank == 0:
            start = time.time()
            try:
                dist.all_reduce(torch.ones(1))  # rank 1 never joins
            except RuntimeError as error:
                print(f"stopped after {time.time() - start:.1f} s: {error}", flush=True)
        else:
            time.sleep(10)  # alive, so that rank 0 waits rather than sees a closed connection
        os._exit(0)  # not through the broken group's teardown (gloo's threads abort the process there)
    """)
    assert "Timed out waiting 3000ms" in output and float(output.split()[2]) < 10, output

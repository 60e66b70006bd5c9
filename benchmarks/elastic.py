"""Losing and gaining hosts, repeated: three test hosts (network namespaces on one
switch, ``tests/elastic_cluster.py``) run ``ddpkit train --nnodes 2:3`` in exact mode
(global batch 96 in 12 slices, 8 epochs of digits, a checkpoint every 10 steps), every
rank parked after step 34 so that the event lands there:

* ``shrink-kill`` / ``shrink-cut``: host 3 killed (every process) / cut off the network;
* ``grow``: two hosts run, a third starts the same command;
* ``shrink-then-grow``: host 3 killed, the two others park again after step 50, host 3
  starts again;
* ``etcd-first-kill`` / ``etcd-first-cut``: ``--rdzv-backend etcd-v2``, host 1 lost;
* ``c10d-first-kill``: host 1 (the c10d store's) killed: the others must end, exit 69,
  with one line;
* ``after-final``: host 3 killed as the final checkpoint appears (default mode);
* ``default-shrink-kill``: ``shrink-kill`` without ``--exact``.

Per run: every launcher's exit code as expected, the final weights ``torch.equal`` to the
uninterrupted run of the same command on three hosts (exact mode; the default mode's
max |dw| is reported instead), every step once in the sample-id log, and the times from
the loss (or the new host's start) to the change line (workers resumed) and to the
first step trained after it, or to the survivors' exit.

Run as root with etcd-server installed, under the shared lock:
    flock /work/wt/cpu.lock .venv/bin/python benchmarks/elastic.py --repeats 5 --other-repeats 2
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from elastic_cluster import (  # noqa: E402
    CHECKPOINT,
    JOB,
    PARK,
    PAUSED_AT,
    REGROWN_AT,
    Cluster,
    ElasticJob,
    assert_every_step_once,
    assert_same_weights,
    exact_flags,
    last_step,
    wait_until,
)

DEFAULT_JOB = [a for a in JOB if a not in exact_flags()]
EXACT = ("shrink-kill", "shrink-cut", "grow", "shrink-then-grow", "etcd-first-kill",
         "etcd-first-cut")
SCENARIOS = (*EXACT, "c10d-first-kill", "after-final", "default-shrink-kill")
MAIN = ("shrink-kill", "shrink-cut", "grow", "shrink-then-grow")


def _changed(job: ElasticJob, host, words: str):
    return lambda: words in job.log(host)


def _resumed_and_training(job: ElasticJob, watcher, words: str, since: float,
                          resumed_from: int = CHECKPOINT) -> dict:
    """Seconds from ``since`` to the change line on ``watcher`` and to the first step
    trained after it (the workers cut the sample log back to ``resumed_from`` first)."""
    resumed = wait_until("the change line", _changed(job, watcher, words), 120, job)
    trained = wait_until("a step after the resume",
                         lambda: last_step(job.run_dir) > resumed_from, 60, job)
    return {"to_resumed_s": resumed - since, "to_training_s": trained - since}


def _exits(job: ElasticJob, hosts, want: int) -> None:
    for host in hosts:
        code = job.wait(host, 180)
        assert code == want, f"host {host.number} exited {code}, not {want}"


def run_scenario(name: str, workdir: Path, references: dict[str, Path]) -> dict:
    cluster = Cluster(3, workdir)
    backend = "etcd-v2" if name.startswith("etcd") else "c10d"
    argv = DEFAULT_JOB if name.startswith("default") or name == "after-final" else JOB
    job = ElasticJob(cluster, workdir / "run", argv, backend=backend)
    h1, h2, h3 = cluster.hosts
    out: dict = {}
    try:
        if name == "grow":
            for host in (h1, h2):
                job.start(host, **PARK)
            wait_until("parked", lambda: last_step(job.run_dir) >= PAUSED_AT, 180, job)
            t0 = time.monotonic()
            job.start(h3)
            out.update(_resumed_and_training(job, h1, "joined after step", t0, PAUSED_AT))
            _exits(job, cluster.hosts, 0)
        elif name == "after-final":
            for host in cluster.hosts:
                job.start(host)
            final = job.run_dir / "checkpoints" / f"step_{120:09d}.json"
            wait_until("the final checkpoint", final.exists, 180, job)
            t0 = time.monotonic()
            cluster.kill(h3)
            _exits(job, (h1, h2), 0)
            out["to_exit_s"] = time.monotonic() - t0
        else:
            extra = {"DDPKIT_TEST_SLEEP_IN_ROUND": f"1:{REGROWN_AT}:120"}
            for host in cluster.hosts:
                job.start(host, **PARK, **(extra if name == "shrink-then-grow" else {}))
            wait_until("parked", lambda: last_step(job.run_dir) >= PAUSED_AT, 180, job)
            lost = h1 if "first" in name else h3
            watcher = h2 if lost is h1 else h1
            t0 = time.monotonic()
            (cluster.cut if name.endswith("cut") else cluster.kill)(lost)
            if name == "c10d-first-kill":
                _exits(job, (h2, h3), 69)
                out["to_exit_s"] = time.monotonic() - t0
                lines = [ln for h in (h2, h3) for ln in job.log(h).splitlines()
                         if ln.startswith("ddpkit launch:")]
                assert len(lines) == 2 and all("the first host" in ln for ln in lines), lines
            else:
                out.update(_resumed_and_training(job, watcher, "lost after step", t0))
                if name == "shrink-then-grow":
                    wait_until("parked again",
                               lambda: last_step(job.run_dir) >= REGROWN_AT, 120, job)
                    job.start(h3)
                    wait_until("joined", _changed(job, h1, "joined after step"), 120, job)
                survivors = cluster.hosts if name == "shrink-then-grow" else [
                    h for h in cluster.hosts if h is not lost]
                _exits(job, survivors, 0)
                if name.endswith("cut"):
                    assert not cluster.pids(lost), "a process of the cut host is left"
                    assert job.wait(lost, 5) == 69
        if name in EXACT:
            assert_same_weights(job.run_dir, references["exact"])
            assert_every_step_once(job.run_dir, references["exact"])
        elif name == "default-shrink-kill":
            assert_every_step_once(job.run_dir, references["default"])
            out["max_dw"] = _max_dw(job.run_dir, references["default"])
        out["ok"] = True
    except AssertionError as err:
        out.update(ok=False, why=str(err).splitlines()[0][:200])
        traceback.print_exc(limit=1)
    finally:
        job.close()
        cluster.close()
    return out


def _max_dw(run: Path, reference: Path) -> float:
    got = torch.load(run / "model.pt", weights_only=True)
    want = torch.load(reference / "model.pt", weights_only=True)
    return max(float((got[k] - want[k]).abs().max()) for k in want)


def uninterrupted(workdir: Path, argv: list[str]) -> Path:
    """The same command on three hosts, nothing lost: the reference."""
    cluster = Cluster(3, workdir)
    job = ElasticJob(cluster, workdir / "run", argv)
    try:
        for host in cluster.hosts:
            job.start(host)
        _exits(job, cluster.hosts, 0)
    finally:
        job.close()
        cluster.close()
    return job.run_dir


def _cell(values: list[float]) -> str:
    if not values:
        return "-"
    return f"{statistics.median(values):.1f} ({min(values):.1f}-{max(values):.1f})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5,
                        help="runs of shrink, grow and shrink-then-grow")
    parser.add_argument("--other-repeats", type=int, default=2,
                        help="runs of each other scenario")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    args = parser.parse_args()
    base = Path(tempfile.mkdtemp(prefix="ddpkit-elastic-"))
    names = args.scenarios.split(",")
    # only the uninterrupted runs the chosen scenarios compare with (each is a job)
    references = {}
    if any(n in EXACT for n in names):
        references["exact"] = uninterrupted(base / "ref-exact", JOB)
    if "default-shrink-kill" in names:
        references["default"] = uninterrupted(base / "ref-default", DEFAULT_JOB)
    rows = []
    for name in names:
        repeats = args.repeats if name in MAIN else args.other_repeats
        results = [run_scenario(name, base / f"{name}-{i}", references)
                   for i in range(repeats)]
        for i, r in enumerate(results):
            print(f"{name} #{i + 1}: {r}", flush=True)
        ok = sum(r["ok"] for r in results)
        rows.append(
            f"| {name} | {ok}/{len(results)} | "
            f"{_cell([r['to_resumed_s'] for r in results if 'to_resumed_s' in r])} | "
            f"{_cell([r['to_training_s'] for r in results if 'to_training_s' in r])} | "
            f"{_cell([r['to_exit_s'] for r in results if 'to_exit_s' in r])} | "
            + (f"{max(r.get('max_dw', 0.0) for r in results):.1e} |"
               if name.startswith("default") else
               ("0 (torch.equal in every run ok) |" if name in EXACT else "- |")))
    print("\n| scenario | runs ok | to resumed, s | to training, s | to exit, s | max abs dw |")
    print("|---|---|---|---|---|---|")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())

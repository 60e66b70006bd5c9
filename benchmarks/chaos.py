"""Chaos run: ``ddpkit train`` under the faults a real job meets, tried as a user would.

    flock /tmp/ddpkit-heavy.lock .venv/bin/python benchmarks/chaos.py [--runs 2] \\
        [--only worker-sigkill,disk-full,...] [--seed 0] [--json chaos.json]

Every scenario starts ``ddpkit train`` (2 processes, synthetic data, 750 optimizer steps
over 2 epochs, a checkpoint every 25 steps) as a subprocess, inflicts its fault from
outside, as an operator, a scheduler or the kernel would, and where the run can go on,
reruns the same command line. Each one is checked for:

* **outcome**: the final weights ``torch.equal`` to an uninterrupted run's, or the
  refusal the fault calls for (one error line, the documented exit code);
* **cleanup**: every process of the run gone within seconds of its end, its launcher's
  SIGKILL included (found through a marker variable in their environment), and no
  shared-memory segment of theirs left in /dev/shm;
* **words**: no traceback (but the one of a rank that raised) and no C++ frame dump;
* **exposure**: every socket the run listened on is a loopback one.

``data lost`` counts the optimizer steps that were trained again (or could not be kept).
Disk-full scenarios mount a small tmpfs (root only; skipped otherwise). Prints a table
(fault, runs, outcome, data lost) for docs/reliability.md; ``--json`` keeps every run.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import torch  # noqa: E402

import chaos_harness as ch  # noqa: E402

# Long enough (about 10 s of steps here) for a fault at a random moment to land mid-run.
SAMPLES, BATCH, EPOCHS, EVERY = 12000, 32, 2, 25
STEPS_PER_EPOCH = -(-SAMPLES // BATCH)  # the last batch of an epoch is padded
STEPS = EPOCHS * STEPS_PER_EPOCH
JOB = ["--nproc-per-node", "2", "--data", "synthetic", "--synthetic-size", str(SAMPLES),
       "--batch-size", str(BATCH), "--epochs", str(EPOCHS), "--hidden", "64", "--threads", "1",
       "--no-progress", "--checkpoint-every-steps", str(EVERY), "--keep", "100"]
EXIT_DISK_FULL, EXIT_HANG, EXIT_PREEMPTED = 74, 124, 75


@dataclass
class Result:
    fault: str
    ok: bool = True
    outcome: str = ""
    data_lost: int | None = None  # optimizer steps trained again, or lost
    cleanup_s: float | None = None  # launcher's end (or kill) to the last process gone
    problems: list[str] = field(default_factory=list)

    def fail(self, what: str) -> None:
        self.ok = False
        self.problems.append(what)


class Chaos:
    def __init__(self, work: Path, seed: int):
        self.work = work
        self.rng = random.Random(seed)
        self.reference: dict[str, torch.Tensor] = {}
        self.sizes: dict[str, int] = {}

    # ---------------------------------------------------------------- running
    def start(self, run: Path, *argv: str, marker: str, job: list[str] = JOB,
              **env: str) -> subprocess.Popen:
        """``ddpkit train JOB --run-dir RUN ARGV`` with the run's marker in its environment."""
        full = {k: v for k, v in os.environ.items() if not k.startswith("DDPKIT_TEST_")}
        full.update(OMP_NUM_THREADS="1", **{ch.MARKER: marker}, **env)
        return subprocess.Popen([sys.executable, "-m", "ddpkit.cli", "train", *job,
                                 "--run-dir", str(run), *argv], env=full, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT)

    @staticmethod
    def finish(proc: subprocess.Popen, limit: float = 300) -> tuple[int, str]:
        try:
            out, _ = proc.communicate(timeout=limit)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
            return -999, out + f"\n[chaos: ddpkit train did not end within {limit} s]"
        return proc.returncode, out

    def run(self, result: Result, run: Path, *argv: str, job: list[str] = JOB,
            tracebacks: int = 0, **env: str) -> tuple[int, str]:
        """One whole command, with the checks every run gets."""
        marker = uuid.uuid4().hex
        with ch.Watch(marker) as watch:
            code, text = self.finish(self.start(run, *argv, marker=marker, job=job, **env))
        self.after(result, marker, watch, text, tracebacks)
        return code, text

    def after(self, result: Result, marker: str, watch: ch.Watch, text: str,
              tracebacks: int = 0) -> None:
        gone = ch.seconds_until_gone(marker, limit=15)
        if gone is None:
            result.fail("processes outlived the run by 15 s (killed)")
        else:
            result.cleanup_s = max(result.cleanup_s or 0.0, gone)
        leaked = ch.leaked_segments(watch.pids)
        if leaked:
            result.fail(f"shared-memory segments left: {leaked}")
        exposed = sorted(s for s in watch.listening if not ch.is_loopback(s))
        if exposed:
            result.fail(f"listened on non-loopback addresses: {exposed}")
        if ch.FRAME_DUMP.search(text):
            result.fail("C++ frame dump in the output")
        if text.count("Traceback") > tracebacks:
            first = text.index("Traceback")
            result.fail(f"{text.count('Traceback')} tracebacks in the output, the first: "
                        f"{text[first:first + 3000]}")

    def park(self, run: Path, step: int, seconds: float, *argv: str,
             job: list[str] = JOB) -> tuple[subprocess.Popen, str, ch.Watch]:
        """Start a run whose ranks all pause ``seconds`` after ``step``; return once they
        are there: its sample log (--log-sample-ids) reached ``step``, or else the last
        checkpoint before it is on disk (the steps from there are a blink)."""
        marker = uuid.uuid4().hex
        proc = self.start(run, *argv, marker=marker, job=job,
                          DDPKIT_TEST_SLEEP_AT_STEP=f"{step}:*:{seconds}")
        watch = ch.Watch(marker).__enter__()
        if "--log-sample-ids" in (*argv, *job):
            self.wait(lambda: steps_logged(run) >= step, proc)
        else:
            self.wait(lambda: (checkpoint_steps(run) or [0])[-1] >= step // EVERY * EVERY,
                      proc)
            time.sleep(0.3)
        return proc, marker, watch

    @staticmethod
    def wait(condition: Callable[[], bool], proc: subprocess.Popen, limit: float = 180) -> None:
        deadline = time.monotonic() + limit
        while not condition():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the run ended or stalled first:\n{proc.communicate()[0]}")
            time.sleep(0.05)

    def same_as_reference(self, result: Result, run: Path) -> None:
        try:
            final = torch.load(run / "model.pt", weights_only=True)
        except OSError as err:
            result.fail(f"no final weights ({err.strerror})")
            return
        if final.keys() != self.reference.keys() or not all(
                torch.equal(final[k], self.reference[k]) for k in final):
            result.fail("final weights differ from the uninterrupted run")
        elif not result.outcome:
            result.outcome = "same weights"

    def expect(self, result: Result, code: int, want: int, text: str) -> None:
        if code != want:
            result.fail(f"exit {code}, expected {want}: {text[-1500:]}")

    # ---------------------------------------------------------------- scenarios
    def reference_run(self) -> None:
        result = Result("reference")
        run = self.work / "reference"
        code, text = self.run(result, run)
        if code != 0 or not result.ok:
            raise SystemExit(f"the uninterrupted run failed ({result.problems}):\n{text}")
        self.reference = torch.load(run / "model.pt", weights_only=True)
        for path in run.rglob("*"):
            if path.is_file():
                self.sizes[str(path.relative_to(run))] = path.stat().st_size

    def checkpoint_pages(self, step: int) -> int:
        """Pages the files of step ``step``'s checkpoint take, its manifest aside."""
        where = f"checkpoints/step_{step:09d}/"
        return sum(ch.pages(size) for name, size in self.sizes.items()
                   if name.startswith(where) and not name.endswith("manifest.json"))

    def worker_sigkill(self, result: Result) -> None:
        """SIGKILL of a random worker at a random moment, twice, under --max-restarts."""
        run = self.work / f"kill-{uuid.uuid4().hex[:6]}"
        marker = uuid.uuid4().hex
        proc = self.start(run, "--max-restarts", "3", "--log-sample-ids", marker=marker)
        done: list[int] = []  # steps rank 0 had logged at each kill
        with ch.Watch(marker) as watch:
            for attempt in range(2):
                floor = max(EVERY, done[-1] + 1 if done else 0)
                self.wait(lambda a=attempt, f=floor: attempt_alive(marker, a) and
                          (checkpoint_steps(run) or [0])[-1] >= f, proc)
                time.sleep(self.rng.uniform(0, 0.8))
                victims = attempt_pids(marker, attempt)
                if steps_logged(run) >= STEPS - 2 or len(victims) < 2:
                    break
                done.append(steps_logged(run))
                os.kill(self.rng.choice(victims), signal.SIGKILL)
            code, text = self.finish(proc)
        self.after(result, marker, watch, text)
        self.expect(result, code, 0, text)
        resumed = [int(s) for s in re.findall(r"resumed at step (\d+) ", text)]
        if len(resumed) != len(done):
            result.fail(f"{len(done)} kills but {len(resumed)} resumes")
        result.data_lost = sum(d - r for d, r in zip(done, resumed))
        result.outcome = f"{len(done)} kills, restarted"
        self.same_as_reference(result, run)

    def launcher_sigkill(self, result: Result) -> None:
        """SIGKILL of `ddpkit train --max-restarts 2` itself; then the same command."""
        run = self.work / f"launcher-{uuid.uuid4().hex[:6]}"
        marker = uuid.uuid4().hex
        argv = ("--max-restarts", "2", "--log-sample-ids")
        proc = self.start(run, *argv, marker=marker)
        with ch.Watch(marker) as watch:
            self.wait(lambda: len(checkpoint_steps(run)) >= 1, proc)
            time.sleep(self.rng.uniform(0, 1.5))
            proc.kill()
            text = proc.communicate()[0]
            done = steps_logged(run)
            before = checkpoint_steps(run)
        gone = ch.seconds_until_gone(marker, limit=15)
        if gone is None or gone > 5:
            result.fail(f"workers outlived their launcher ({gone} s)")
        result.cleanup_s = gone
        self.after(result, marker, watch, text)
        time.sleep(1)
        if checkpoint_steps(run) != before:
            result.fail("a checkpoint was written after the launcher died")
        code, text = self.run(result, run, *argv)
        self.expect(result, code, 0, text)
        resumed = resumed_step(text)
        result.data_lost = None if resumed is None else done - resumed
        self.same_as_reference(result, run)

    def sigterm_rerun(self, result: Result) -> None:
        """SIGTERM (a scheduler's preemption): exit 75, then the same command continues."""
        run = self.work / f"term-{uuid.uuid4().hex[:6]}"
        marker = uuid.uuid4().hex
        proc = self.start(run, "--log-sample-ids", marker=marker)
        with ch.Watch(marker) as watch:
            self.wait(lambda: len(checkpoint_steps(run)) >= 1, proc)
            time.sleep(self.rng.uniform(0, 1.5))
            proc.send_signal(signal.SIGTERM)
            code, text = self.finish(proc)
        self.after(result, marker, watch, text)
        if code == 0:  # the signal came after the last step: nothing to stop
            result.outcome = "ended before the signal"
        else:
            self.expect(result, code, EXIT_PREEMPTED, text)
            if "(or the same command again)" not in text:
                result.fail("the stop line does not say the same command continues")
            code, text = self.run(result, run, "--log-sample-ids")
            self.expect(result, code, 0, text)
            result.data_lost = 0 if "stopped at step" in text else None
        self.same_as_reference(result, run)

    def damaged(self, result: Result, damage: ch.Damage | None) -> None:
        """Stop a run (SIGTERM) after 3 checkpoints, damage the newest one, rerun."""
        run = self.work / f"damage-{uuid.uuid4().hex[:6]}"
        proc, marker, watch = self.park(run, 3 * EVERY + 2, 60)
        proc.send_signal(signal.SIGTERM)
        code, text = self.finish(proc)
        watch.__exit__()
        self.after(result, marker, watch, text)
        self.expect(result, code, EXIT_PREEMPTED, text)
        ckpt = run / "checkpoints"
        steps = checkpoint_steps(run)
        newest, older = steps[-1], steps[-2]
        if damage is None:
            ch.damage_everything(ckpt)
            code, text = self.run(result, run)
            self.expect(result, code, 2, text)
            if not re.search(r"every checkpoint in .* is damaged \(see the warnings above\); "
                             r"nothing to resume", text):
                result.fail("no 'every checkpoint is damaged' line")
            if "no older checkpoint to fall back to" not in text:
                result.fail("the oldest one's warning is wrong")
            result.outcome, result.data_lost = "refused: every checkpoint damaged", newest
            return
        damage.apply(ckpt, newest, older)
        code, text = self.run(result, run)
        self.expect(result, code, 0, text)
        if damage.falls_back:
            if not re.search(ch.words_for(damage, ckpt, newest, older), text):
                result.fail(f"no warning naming it ({damage.says!r})")
            if f"resumed at step {older} " not in text:
                result.fail(f"did not fall back to step {older}")
            result.data_lost = newest - older
            result.outcome = "named, fell back"
        else:
            result.data_lost = 0
            result.outcome = "newest used"
        self.same_as_reference(result, run)

    def disk_full(self, result: Result, target: str) -> None:
        """Fill a small filesystem so that ``target`` is the write that fails; the run must
        end with one line and exit 74, no restart, no debris; after freeing space the
        same command continues."""
        job = JOB  # keeps every checkpoint: the sizes below hold, no rotation frees space
        argv = ["--max-restarts", "2"]
        # The writes after the last step are targeted once its sample-log line is out (a
        # checkpoint there would only be written after the pause, too late to fill the disk).
        after_last = target in ("final weights", "summary", "final weights (--no-checkpoints)")
        extra = ((["--no-checkpoints"] if target == "final weights (--no-checkpoints)" else [])
                 + (["--log-sample-ids"] if after_last else []))
        ckpt_step = 2 * EVERY
        # The epoch's record is written before its checkpoint: park one step before its end.
        park = {"checkpoint payload": 2 * EVERY - 3, "checkpoint manifest": 2 * EVERY - 3,
                "metrics record": STEPS_PER_EPOCH - 1, "final weights": STEPS,
                "final weights (--no-checkpoints)": STEPS, "summary": STEPS}.get(target)
        # Room for the writes before the target (sizes from the uninterrupted run), in pages:
        # a checkpoint's files but its manifest (DCP's data and metadata, run.pt).
        payload = self.checkpoint_pages(ckpt_step)
        final = self.checkpoint_pages(STEPS) + ch.PAGE
        leave = {"checkpoint manifest": payload, "final weights": final,
                 "summary": final + ch.pages(self.sizes["model.pt"])}.get(target, 0)
        expected = {"checkpoint payload": f"checkpoints/step_{ckpt_step:09d}",
                    "checkpoint manifest": f"checkpoints/step_{ckpt_step:09d}",
                    "metrics record": "metrics.jsonl", "final weights": "model.pt",
                    "final weights (--no-checkpoints)": "model.pt",
                    "summary": "summary.json", "first write": "checkpoints"}[target]
        with ch.small_filesystem(32) as disk:
            run = disk / "run"
            if park is None:  # the very first write
                filler = ch.fill(disk)
                marker = uuid.uuid4().hex
                with ch.Watch(marker) as watch:
                    code, text = self.finish(self.start(run, *argv, *extra, marker=marker,
                                                        job=job))
            else:
                proc, marker, watch = self.park(run, park, 6, *argv, *extra, job=job)
                filler = ch.fill(disk, leave)
                code, text = self.finish(proc)
                watch.__exit__()
            self.after(result, marker, watch, text)
            self.expect(result, code, EXIT_DISK_FULL, text)
            errors = [line for line in text.splitlines() if "error" in line.lower()]
            path = re.escape(str(run / expected))
            if len(errors) != 1 or not re.search(
                    rf"no space left on device (to write {path}: it needs [\d,]+ bytes|"
                    rf"writing in {path} \()", errors[0]):
                result.fail(f"not one line naming {expected}: {errors} {text[-2000:]}")
            if text.count("run directory:") > 1:
                result.fail("restarted into the same failure")
            debris = [str(p.relative_to(run)) for p in run.rglob("*") if ".tmp" in p.name]
            if debris:
                result.fail(f"debris left: {debris}")
            if target != "summary" and (run / "summary.json").exists():
                result.fail("summary.json written before the weights")
            failed_at = {"checkpoint payload": ckpt_step, "checkpoint manifest": ckpt_step,
                         "metrics record": STEPS_PER_EPOCH}.get(target, STEPS if park else 0)
            kept = checkpoint_steps(run)
            filler.unlink()
            code, text = self.run(result, run, *argv, *extra, job=job)
            if "--no-checkpoints" in extra:  # nothing to continue from
                self.expect(result, code, 2, text)
                if "nothing to continue" not in text:
                    result.fail("the rerun does not say why it cannot continue")
                result.outcome, result.data_lost = "one line; rerun refused (no checkpoints)", STEPS
                return
            self.expect(result, code, 0, text)
            result.data_lost = failed_at - (kept[-1] if kept else 0)
            result.outcome = "one line, exit 74; rerun continued"
            self.same_as_reference(result, run)

    def sigstop(self, result: Result) -> None:
        """A rank stopped with SIGSTOP: named after --collective-timeout; everything ends."""
        run = self.work / f"stop-{uuid.uuid4().hex[:6]}"
        proc, marker, watch = self.park(run, EVERY + 2, 2, "--collective-timeout", "4",
                                        "--max-restarts", "1")
        victim = ch.worker_pid(marker, self.rng.randrange(2))
        os.kill(victim, signal.SIGSTOP)
        code, text = self.finish(proc)
        watch.__exit__()
        self.after(result, marker, watch, text)
        self.expect(result, code, 0, text)  # the restart continues without it
        # Stopped before the collective: "waited ... for rank N"; stopped inside it (it
        # had reached the point): "rank N (no heartbeat for ...) ... stopped running".
        if not re.search(r"ddpkit train: error: rank \d:? (waited [\d.]+ s at step \d+ .* "
                         r"for rank \d|.*rank \d \(no heartbeat for \d+ s\) reached it, then "
                         r"stopped running)", text):
            result.fail("the hang line naming the stopped rank is missing")
        result.data_lost = 2  # resumed from the checkpoint 2 steps before the stop
        self.same_as_reference(result, run)

    def rank_raises(self, result: Result) -> None:
        """A rank raises in its step: its traceback once, one root-cause line; restarted."""
        run = self.work / f"raise-{uuid.uuid4().hex[:6]}"
        step, rank = self.rng.randrange(EVERY + 1, STEPS - 1), self.rng.randrange(2)
        code, text = self.run(result, run, "--max-restarts", "1", tracebacks=1,
                              DDPKIT_TEST_RAISE_AT_STEP=f"{step}:{rank}")
        self.expect(result, code, 0, text)
        if f"injected failure at step {step}" not in text:
            result.fail("the raising rank's error is not shown")
        result.data_lost = step - step // EVERY * EVERY
        self.same_as_reference(result, run)

    def two_writers(self, result: Result) -> None:
        """A second `ddpkit train --resume` while the first still runs is refused."""
        run = self.work / f"two-{uuid.uuid4().hex[:6]}"
        proc, marker, watch = self.park(run, EVERY + 1, 8)
        code, text = self.run(result, run)  # the same command line, while the first runs
        self.expect(result, code, 2, text)
        if f"run directory {run} is in use by ddpkit train (pid {proc.pid} on host" not in text:
            result.fail(f"the refusal does not name the holder: {text[-500:]}")
        code, text = self.finish(proc)
        watch.__exit__()
        self.after(result, marker, watch, text)
        self.expect(result, code, 0, text)
        result.data_lost = 0
        result.outcome = "second refused, first finished"
        self.same_as_reference(result, run)


# ---------------------------------------------------------------------- run state
def checkpoint_steps(run: Path) -> list[int]:
    ckpt = run / "checkpoints"
    if not ckpt.is_dir():
        return []
    return sorted(int(p.parent.name[5:]) for p in ckpt.glob("step_*/manifest.json"))


def steps_logged(run: Path) -> int:
    """Optimizer steps rank 0 has logged (--log-sample-ids)."""
    try:
        return len((run / "sample_ids" / "rank0.jsonl").read_text().splitlines())
    except OSError:
        return 0


def resumed_step(text: str) -> int | None:
    """The step the last attempt in ``text`` resumed from."""
    found = re.findall(r"resumed at step (\d+) ", text)
    return int(found[-1]) if found else None


def attempt_pids(marker: str, attempt: int) -> list[int]:
    """The workers of the agent's attempt ``attempt`` (0: the first start)."""
    return [pid for pid in ch.marked(marker)
            if ch.environ(pid).get("TORCHELASTIC_RESTART_COUNT") == str(attempt)]


def attempt_alive(marker: str, attempt: int) -> bool:
    return len(attempt_pids(marker, attempt)) == 2


# ---------------------------------------------------------------------- main
def scenarios(chaos: Chaos, runs: int, root: bool) -> list[tuple[str, Callable[[Result], None]]]:
    plan: list[tuple[str, Callable[[Result], None]]] = []
    plan += [("SIGKILL of a worker, twice (--max-restarts 3)", chaos.worker_sigkill)] * 2 * runs
    plan += [("SIGKILL of the launcher (--max-restarts 2), same command again",
              chaos.launcher_sigkill)] * runs
    plan += [("SIGTERM (preemption), same command again", chaos.sigterm_rerun)] * runs
    for damage in ch.DAMAGES:
        plan.append((f"damaged newest checkpoint: {damage.name}",
                     lambda r, d=damage: chaos.damaged(r, d)))
    plan.append(("every checkpoint damaged", lambda r: chaos.damaged(r, None)))
    if root:
        for target in ("first write", "checkpoint payload", "checkpoint manifest",
                       "metrics record", "final weights", "summary",
                       "final weights (--no-checkpoints)"):
            plan.append((f"disk full at the {target}", lambda r, t=target: chaos.disk_full(r, t)))
    plan += [("a rank stopped with SIGSTOP (--max-restarts 1)", chaos.sigstop)] * runs
    plan += [("a rank raises in its step (--max-restarts 1)", chaos.rank_raises)] * runs
    plan += [("a second writer started on the run directory", chaos.two_writers)]
    return plan


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=2, help="repeats of each random scenario")
    p.add_argument("--only", default="", help="comma-separated words; scenarios whose name "
                                              "holds one of them")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write every run's result here")
    args = p.parse_args()
    root = ch.can_mount()
    with tempfile.TemporaryDirectory(prefix="ddpkit-chaos-") as work:
        chaos = Chaos(Path(work), args.seed)
        started = time.monotonic()
        chaos.reference_run()
        results: list[Result] = []
        words = [w.strip() for w in args.only.split(",") if w.strip()]
        for name, scenario in scenarios(chaos, args.runs, root):
            if words and not any(w in name for w in words):
                continue
            result = Result(name)
            try:
                scenario(result)
            except Exception as err:  # one broken scenario must not hide the others
                result.fail(f"{type(err).__name__}: {err}"[:500])
            print(f"{'ok ' if result.ok else 'BAD'} {name}: {result.outcome} "
                  f"lost={result.data_lost} cleanup={result.cleanup_s} {result.problems}",
                  flush=True)
            results.append(result)
    print_table(results)
    print(f"\n{len(results)} scenarios, {sum(not r.ok for r in results)} bad, "
          f"{time.monotonic() - started:.0f} s; {time.strftime('%Y-%m-%d')}; "
          f"disk-full scenarios {'run' if root else 'skipped (not root)'}")
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in results], indent=1))
    return 0 if all(r.ok for r in results) else 1


def print_table(results: list[Result]) -> None:
    groups: dict[str, list[Result]] = {}
    for r in results:
        groups.setdefault(r.fault, []).append(r)
    print("\n| fault | runs | outcome | data lost (steps) | slowest cleanup (s) |")
    print("|---|---|---|---|---|")
    for fault, rs in groups.items():
        bad = [r for r in rs if not r.ok]
        outcome = (f"{len(rs) - len(bad)}/{len(rs)} as required" +
                   (f"; {sorted({r.outcome for r in rs if r.outcome})[0]}" if rs[0].outcome
                    else "") + (f"; BAD: {bad[0].problems}" if bad else ""))
        lost = [r.data_lost for r in rs if r.data_lost is not None]
        lost_text = "-" if not lost else (f"{min(lost)}" if min(lost) == max(lost)
                                          else f"{min(lost)}-{max(lost)}")
        clean = [r.cleanup_s for r in rs if r.cleanup_s is not None]
        print(f"| {fault} | {len(rs)} | {outcome} | {lost_text} | "
              f"{max(clean):.1f} |" if clean else f"| {fault} | {len(rs)} | {outcome} | "
              f"{lost_text} | - |")


if __name__ == "__main__":
    sys.exit(main())

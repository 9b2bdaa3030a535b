"""The fences' mutation table: each fence removed in turn, and the test named after it must fail.

A guard that no test notices when removed is untested. For every row below, this copies the checkout's
files (those git tracks or would) into a scratch folder, replaces the guard's line(s) with a no-op, runs the row's tests on
`SimCuda` against the copy, and reports whether they failed (they must) or passed (the table is broken). A row
whose code is not found fails too: the table must follow the code.

    python scripts/fence_mutations.py            # every row; exit 1 unless every mutant is caught
    python scripts/fence_mutations.py --list     # the rows, each guard's code looked up, nothing run
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ORDERING, GENERIC = "tests/core/test_ordering.py", "tests/core/test_ordering_generic.py"

# (guard, file under offload_core/, the exact text removed, what replaces it, the tests that must fail)
ROWS = [
    ("release fence of the slot served last", "store/ring.py",
     "self.current.release = self._streams.record()", "pass",
     f"{ORDERING}::test_a_slot_is_overwritten_only_after_the_kernels_reading_it"),
    ("a RAM load waits for the slot's release", "tiers/ram.py",
     "release.make_wait(side)  # no-op without a side stream", "pass  #",
     f"{ORDERING}::test_a_slot_is_overwritten_only_after_the_kernels_reading_it"),
    ("a file load waits for the slot's release", "tiers/file/fileread.py",
     "release.make_wait(side)", "pass",
     f"{ORDERING}::test_a_slot_is_overwritten_only_after_the_kernels_reading_it"),
    ("the side stream waits for a put's snapshot", "tiers/ram.py",
     "streams.record().make_wait(side)  # the side stream", "pass  #",
     f"{ORDERING}::test_a_put_is_snapshotted_before_later_kernels_change_its_source"),
    ("at most depth + 1 snapshots in flight", "tiers/ram.py",
     "self._offloads.popleft().synchronize()", "self._offloads.popleft()",
     f"{ORDERING}::test_offloading_keeps_at_most_depth_plus_one_snapshots_on_the_device"),
    ("the drain before the tiers are closed", "tiers/registry.py",
     "        streams.drain()\n", "        pass\n",
     f"{ORDERING}::test_closing_right_after_the_puts_waits_for_the_offloads"),
    ("the settle before a slot grows", "store/ring.py",
     "slot.pending.settle()  # the old buffers may still be the target of a copy", "pass",
     f"{ORDERING}::test_a_slot_grows_only_after_the_copy_into_it_finished"),
    ("the release fence of a new slot", "store/ring.py",
     "        slot.release = self._streams.record()\n        self._stats", "        pass\n        self._stats",
     f"{ORDERING}::test_a_new_slot_waits_for_the_kernels_still_using_its_memory"),
    ("a staged chunk is written after its copy", "tiers/file/filewrite.py",
     "lease.item[1].synchronize()  # the copy into the buffer has finished", "pass",
     f"{GENERIC}::test_a_chunk_is_written_only_after_its_copy_into_the_staging_buffer"),
    ("staging freed after its copy (trim)", "tiers/file/staging.py",
     "            for item in idle:\n                item[1].synchronize()\n", "            for item in idle:\n",
     f"{GENERIC}::test_a_staging_buffer_is_freed_only_after_the_copy_into_it[trim]"),
    ("the dedup check waits for the rows' kernels", "store/dedup.py",
     "devices.wait_for_device(k.device)", "pass",
     f"{ORDERING}::test_the_dedup_check_reads_rows_only_once_the_kernels_writing_them_ran[rows_differ]"),
    ("staging freed after its copy (close)", "tiers/file/staging.py",
     "        for item in self._all:\n            item[1].synchronize()\n", "        for item in self._all:\n",
     f"{GENERIC}::test_a_staging_buffer_is_freed_only_after_the_copy_into_it[close]"),
]


def mutate(tree: str, path: str, old: str, new: str) -> bool:
    full = os.path.join(tree, "offload_core", path)
    with open(full) as f:
        text = f.read()
    if text.count(old) != 1:
        return False
    with open(full, "w") as f:
        f.write(text.replace(old, new))
    return True


def _found(row) -> bool:
    with open(os.path.join(ROOT, "offload_core", row[1])) as f:
        return f.read().count(row[2]) == 1


def run_row(row, python: str, mutated: bool = True) -> str:
    """'caught' when the row's tests fail on the mutant (unmutated: 'passes' when they pass on the copy)."""
    guard, path, old, new, tests = row
    with tempfile.TemporaryDirectory(prefix="kv-offload-mutant-") as tree:
        files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True,
                               text=True, check=True).stdout.split("\n")
        for name in filter(None, files):
            if os.path.isfile(os.path.join(ROOT, name)):
                os.makedirs(os.path.dirname(os.path.join(tree, name)), exist_ok=True)
                shutil.copy(os.path.join(ROOT, name), os.path.join(tree, name))
        if mutated and not mutate(tree, path, old, new):
            return "GUARD NOT FOUND (the table no longer follows the code)"
        env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
        cmd = [python, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *tests.split()]
        done = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=600)
        check = subprocess.run([python, "-c", "import offload_core; print(offload_core.__file__)"], env=env,
                               capture_output=True, text=True, cwd=tree)  # the copy, first on sys.path
        if not check.stdout.startswith(tree):
            return "NOT RUN (the mutant was not the offload_core imported)"
        if not mutated:
            return "passes" if done.returncode == 0 else f"FAILS UNMUTATED (pytest exit {done.returncode})"
        return "caught" if done.returncode == 1 else f"NOT CAUGHT (pytest exit {done.returncode})"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--list", action="store_true", help="print the rows without running them")
    args = p.parse_args(argv)
    width = max(len(r[0]) for r in ROWS)
    results = []
    if not args.list:  # the control: every row's tests pass on the copy as it is
        control = ("(control: nothing removed)", "", "", "",
                   " ".join(dict.fromkeys(r[4] for r in ROWS)))
        results.append("caught" if run_row(control, sys.executable, mutated=False) == "passes" else "control failed")
        print(f"{control[0]:<{width}}  {'':<20}  {'passes' if results[0] == 'caught' else results[0]}", flush=True)
    for row in ROWS:
        result = (("found" if _found(row) else "GUARD NOT FOUND") if args.list else run_row(row, sys.executable))
        results.append(result)
        print(f"{row[0]:<{width}}  {row[1]:<20}  {result}", flush=True)
    return 0 if all(r in ("caught", "found") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())

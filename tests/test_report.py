"""The benchmarks' harness: benchmarks/report.py writes the latest figures of benchmarks/results/ into
benchmarks/README.md between each benchmark's markers; bench_save's rows, pairs and pooling; the
Lightning job's summaries (synthetic figures: no benchmark is run)."""

from __future__ import annotations

import importlib.util
import os
import statistics
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
BENCHMARKS = os.path.join(HERE, "..", "benchmarks")


@pytest.fixture(scope="module")
def report():
    spec = importlib.util.spec_from_file_location("bench_report", os.path.join(BENCHMARKS, "report.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is created
    spec.loader.exec_module(module)
    return module


def test_the_readme_holds_the_figures_of_results(report):
    """benchmarks/README.md shows, per benchmark, what report.py renders from benchmarks/results/:
    after adding or removing a result file, re-render with `.venv/bin/python benchmarks/report.py`."""
    with open(os.path.join(BENCHMARKS, "README.md")) as f:
        text = f.read()
    assert report.render_readme(text, os.path.join(BENCHMARKS, "results")) == text
    for section in report.SECTIONS:
        assert f"\n## {section}\n" in text  # the anchors the project's README links to


def test_each_family_s_latest_date_is_rendered_between_its_markers(report, tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    table = "| a | b |\n|---|---|\n| 1 | 2 |\n"
    (results / "bench_s3_2026-01-01.md").write_text("# old\n\nRun 2026-01-01, old VM.\n\n" + table)
    (results / "bench_s3_2026-02-01_run_A.md").write_text(
        "# s3\n\nRun 2026-02-01, VM, commit abc.\n\n" + table + "\n| x |\n|---|\n| ratio |\n\n| third |\n|---|\n")
    (results / "bench_lightning_memory_2026-02-01.md").write_text(
        "Run 2026-02-01.\n\n| t |\n|---|\n\n- every step: 2.00 × → FAIL\n")
    (results / "bench_recovery_2026-02-01.json").write_text("{}")  # the Markdown of the same run is shown
    (results / "bench_recovery_2026-02-01.md").write_text(
        "Run 2026-02-01.\n\n| r |\n|---|\n\nmemory / disk: **0.23 x** (target <= 0.3)\n")
    sections = "".join(f"## {s}\n\nHand-written.\n\n{report.markers(s)[0]}\nstale\n{report.markers(s)[1]}\n\n"
                       for s in report.SECTIONS)
    readme = tmp_path / "README.md"
    readme.write_text("# Benchmarks\n\n" + sections + "Tail.\n")
    args = ["--readme", str(readme), "--results", str(results)]
    assert report.main([*args, "--check"]) == 1
    assert report.main(args) == 0
    text = readme.read_text()
    assert "stale" not in text and text.endswith("Tail.\n") and text.count("Hand-written.") == len(report.SECTIONS)
    begin, end = report.markers("bench_s3")
    s3 = text.split(begin)[1].split(end)[0]
    assert "results/bench_s3_2026-02-01_run_A.md" in s3 and "Run 2026-02-01, VM, commit abc" in s3
    assert "2026-01-01" not in s3 and "| ratio |" in s3 and "| third |" not in s3  # its two headline tables
    assert "- every step: 2.00 × → FAIL" in text and "memory / disk: **0.23 x** (target <= 0.3)" in text
    assert "bench_recovery_2026-02-01.json" not in text and "No run of `bench_plan.py`" in text
    assert report.main([*args, "--check"]) == 0 and report.main(args) == 0 and readme.read_text() == text


def test_a_result_named_otherwise_and_a_readme_without_markers_are_refused(report, tmp_path, capsys):
    results = tmp_path / "results"
    results.mkdir()
    (results / "bench_save_run_A.json").write_text("{}")
    readme = tmp_path / "README.md"
    readme.write_text("# Benchmarks\n")
    args = ["--readme", str(readme), "--results", str(results)]
    assert report.main(args) == 2 and "bench_save_run_A.json: not named" in capsys.readouterr().err
    (results / "bench_save_run_A.json").rename(results / "bench_nope_2026-01-01.md")
    assert report.main(args) == 2 and "no benchmark named bench_nope" in capsys.readouterr().err
    (results / "bench_nope_2026-01-01.md").unlink()
    assert report.main(args) == 2 and "lacks the markers" in capsys.readouterr().err
    assert readme.read_text() == "# Benchmarks\n"


@pytest.fixture
def save_rows(monkeypatch):
    """benchmarks/bench_save.py, which also turns its figures into rows and targets."""
    monkeypatch.syspath_prepend(BENCHMARKS)
    return importlib.import_module("bench_save")


def test_the_persist_target_is_paired_round_by_round(save_rows):
    """Each round's faster raw write (buffered or direct) ÷ our time after the stall in the same
    round, the median over saves 2..N; the first save (buffer allocation) is left out."""
    agg = {"ours": {"rep1_after_stall_s": 9.0, "rep2_after_stall_s": 1.0, "rep3_after_stall_s": 2.0,
                    "rep4_after_stall_s": 1.0},
           "raw_write": {"rep1_s": 1.0, "rep2_s": 1.2, "rep3_s": 1.0, "rep4_s": 0.5},
           "raw_write_direct": {"rep1_s": 1.0, "rep2_s": 0.9, "rep3_s": 3.0, "rep4_s": 0.8}}
    ratio = save_rows.paired_persist(agg)
    assert ratio == pytest.approx(0.5)  # ratios 0.9, 0.5, 0.5
    (row,) = save_rows.paired_persist_rows("1", ratio)
    assert row.passed is False and row.target == "≥ 0.90 × limit"
    assert save_rows.paired_persist({"ours": {"after_stall_s": 1.0}}) is None


def test_stall_scaling_is_judged_against_the_fastest_copy_s_own_scaling(save_rows):
    """A 1-rank save copies on every core, so two ranks on the same cores can only scale as that
    copy does: the limit is the fastest copy at 2 ranks ÷ the fastest at 1 rank."""
    peers = {p: {} for p in save_rows.PEERS}
    one = {"ours": {"stall_s": 0.10}, "memcpy": {"stall_s": 0.15}, "memcpy_threads": {"stall_s": 0.09}, **peers}
    two = {"ours": {"stall_s": 0.105}, "memcpy": {"stall_s": 0.095}, "memcpy_threads": {"stall_s": 0.099}, **peers}
    row = save_rows.scaling_row(one, two)
    assert row.limit == pytest.approx(0.095 / 0.09) and row.ours == pytest.approx(1.05)
    assert row.passed is True  # 1.05 ≤ 1.10 × 1.056
    two["ours"]["stall_s"] = 0.12
    assert save_rows.scaling_row(one, two).passed is False


def test_the_stall_target_brackets_each_save_with_the_copy_on_both_sides(save_rows, monkeypatch):
    """bench_save times the copy limit right before every save and right after it; each save is
    judged against the mean of its two copies (a drift of the machine that is linear over the save
    cancels, and neither side's bias counts alone), over saves 2..N; the medians against each side
    alone are shown beside it, informative only."""
    monkeypatch.syspath_prepend(BENCHMARKS)
    from bench_save import paired_stalls

    def save(stall, before, after):
        return {"stall_s": stall, "copy_before_s": before, "copy_after_s": after, "snapshot_s": stall - 0.1}

    saves = [save(9.0, 1.0, 1.0), save(1.2, 1.0, 1.4), save(1.0, 1.0, 1.0), save(1.1, 1.2, 0.8), save(1.3, 1.0, 1.0)]
    paired = paired_stalls(saves)  # steady: 1.2/1.2 = 1.0, 1.0, 1.1/1.0 = 1.1, 1.3
    assert paired["stall_vs_copy_median"] == pytest.approx(1.05) and paired["pairs"] == 4
    assert paired["stall_vs_copy_median_before"] == pytest.approx(statistics.median([1.2, 1.0, 1.1 / 1.2, 1.3]))
    assert paired["stall_vs_copy_median_after"] == pytest.approx(statistics.median([1.2 / 1.4, 1.0, 1.1 / 0.8, 1.3]))
    # the copy inside the save alone, against the same mean: 1.1/1.2, 0.9, 1.0, 1.2
    assert paired["snapshot_vs_copy_median"] == pytest.approx(statistics.median([1.1 / 1.2, 0.9, 1.0, 1.2]))
    main, before, after, copy = save_rows.paired_stall("1", {"paired": paired})
    assert "both sides" in main.metric and main.passed is True and main.target == "≤ 1.10 × limit"
    assert main.ours == pytest.approx(1.05)
    assert before.passed is None and after.passed is None and "(4 saves)" in before.metric
    assert copy.passed is None and "copy alone" in copy.metric and copy.ours == pytest.approx((1.1 / 1.2 + 1.0) / 2)
    assert "right before" in before.metric and "right after" in after.metric
    saves[4] = save(1.5, 1.0, 1.0)
    saves.append(save(1.4, 1.0, 1.0))  # steady: 1.0, 1.0, 1.1, 1.5, 1.4
    assert paired_stalls(saves)["stall_vs_copy_median"] == pytest.approx(1.1) and paired_stalls(saves)["pairs"] == 5


def test_bench_save_times_nothing_while_a_retention_still_runs_and_brackets_each_save(monkeypatch, tmp_path):
    """bench_save's loop of saves (a 1-rank run on a small state, in this process): after each save,
    the deletion of older checkpoints (keep_last, a background thread) is waited for before the
    next timed step, the copy limit or a raw write, so it slows neither; the copy limit runs right
    before every save and right after it."""
    monkeypatch.syspath_prepend(BENCHMARKS)
    import torch

    import bench_save
    from _common import RankCtx
    from ckpt_engine import Checkpointer

    log: list[str] = []
    wait, save = Checkpointer.wait, Checkpointer.save
    monkeypatch.setattr(Checkpointer, "save", lambda self, *a, **k: (log.append("save"), save(self, *a, **k))[1])
    monkeypatch.setattr(Checkpointer, "wait", lambda self, *, retention=False, **k: (
        wait(self, retention=retention, **k), log.append("retention done" if retention else "committed"))[0])
    timed = bench_save.timed

    def logged(fn, *a, **k):
        if fn.__name__ == "copy_threads":
            log.append(fn.__name__)
        return timed(fn, *a, **k)

    monkeypatch.setattr(bench_save, "timed", logged)
    write = bench_save.RawWriter.write
    monkeypatch.setattr(bench_save.RawWriter, "write", lambda self: (log.append("write"), write(self))[1])
    state = {f"w{i}": torch.randn(64, 256) for i in range(4)}
    ctx = RankCtx(0, 1, state, str(tmp_path), reps=4, peer_reps=1)
    out = bench_save.bench_ours(ctx)
    saves = [i for i, e in enumerate(log) if e == "save"][:4]
    assert len(saves) == 4
    for i, at in enumerate(saves):
        assert log[at - 1] == "copy_threads", log[at - 3:at + 3]  # the copy limit right before the save
        after = log[at + 1:(saves[i + 1] if i + 1 < len(saves) else len(log))]
        assert after[:3] == ["committed", "retention done", "copy_threads"], after  # and right after it
    assert out["paired"]["pairs"] == 3  # saves 2..4
    assert len([e for e in log if e == "copy_threads"]) == 8


class FakeClock:
    """A ``time`` module stand-in for timing code under test: ``sleep`` advances ``perf_counter`` at once,
    so what a function measures is exactly the sleeps it contains, whatever the machine's load."""

    def __init__(self) -> None:
        self.now = 1000.0

    def perf_counter(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def test_interleaved_rounds_run_a_contenders_settling_untimed_before_the_next(monkeypatch):
    """bench_s3 runs its contenders in turn; ours returns the wait for its retention (the older
    checkpoint's objects deleted), which must run before the next contender and count for nobody."""
    monkeypatch.syspath_prepend(BENCHMARKS)
    import bench_s3

    clock = FakeClock()
    monkeypatch.setattr(bench_s3, "time", clock)
    log: list[str] = []

    def ours(rep):
        log.append("ours")
        clock.sleep(0.01)
        return lambda: (clock.sleep(0.2), log.append("settled"))

    times = bench_s3.interleaved({"ours": ours, "raw": lambda rep: (clock.sleep(0.03), log.append("raw"))}, reps=2)
    assert log == ["ours", "settled", "raw", "ours", "settled", "raw"]
    assert times == {"ours": [pytest.approx(0.01)] * 2, "raw": [pytest.approx(0.03)] * 2}, times


def test_timed_save_times_stall_and_commit_and_waits_for_the_retention_untimed(monkeypatch):
    """The one way the benchmarks time a save of ours (bench_save, bench_sharded): save() is the stall,
    save() + wait() the time to committed, and the retention (wait(retention=True)) is over when it
    returns but in neither figure."""
    monkeypatch.syspath_prepend(BENCHMARKS)
    import _common

    clock = FakeClock()
    monkeypatch.setattr(_common, "time", clock)

    class Ck:  # what timed_save uses of a Checkpointer, each step taking a known time
        log: list[str] = []

        def save(self, state, step, **kw):
            self.log.append(f"save {step} {kw}")
            clock.sleep(0.05)
            return "handle"

        def wait(self, retention=False):
            self.log.append("retention" if retention else "commit")
            clock.sleep(0.5 if retention else 0.1)

    stall, total, handle = _common.timed_save(Ck(), {}, 3, defer=True)
    assert Ck.log == ["save 3 {'defer': True}", "commit", "retention"] and handle == "handle"
    assert (stall, total) == (pytest.approx(0.05), pytest.approx(0.15))


def test_pooling_runs_takes_every_pair_of_every_run_as_the_slowest_rank_s_times(monkeypatch):
    """benchmarks/pool_runs.py: the pairs of several bench_save runs pooled per world size and
    target, each pair the ratio of the slowest rank's times; the pooled median, a deterministic
    bootstrap interval around it, each run's own median, and the verdict against the target."""
    monkeypatch.syspath_prepend(BENCHMARKS)
    import pool_runs

    def rank(stalls, befores, afters, afters_stall, raws, cold):
        ours = {}
        for i, (s, b, a, p) in enumerate(zip(stalls, befores, afters, afters_stall), 1):
            ours.update({f"rep{i}_stall_s": s, f"rep{i}_copy_before_s": b, f"rep{i}_copy_after_s": a,
                         f"rep{i}_after_stall_s": p})
        writes = {f"rep{i}_s": w for i, w in enumerate(raws, 1)}
        paired = {}
        for i, (o, r) in enumerate(cold, 1):
            paired.update({f"restore_cold_{i}_ours_s": o, f"restore_cold_{i}_raw_s": r,
                           f"restore_cold_{i}_verified_s": r * 1.25})
        for i, s in enumerate(stalls, 1):
            ours[f"rep{i}_snapshot_s"] = s - 0.1
        return {"ours": ours, "raw_write": writes, "raw_write_direct": {k: v * 2 for k, v in writes.items()},
                "paired": paired}

    # rank 1 is slower at the second save (its stall and its copies): the pair divides the slowest times
    r0 = rank([9, 1.0, 1.1], [1, 1.0, 1.0], [1, 1.0, 1.0], [9, 2.0, 2.0], [1, 1.8, 2.0], [(1.0, 1.0), (2.0, 1.0)])
    r1 = rank([9, 1.4, 1.0], [1, 1.2, 1.0], [1, 1.2, 1.0], [9, 2.0, 2.5], [1, 1.9, 2.0], [(1.0, 1.0), (1.0, 1.0)])
    run1 = {"worlds": {"2": {"ranks": [r0, r1]}}}
    pairs = pool_runs.world_pairs(run1["worlds"]["2"]["ranks"])
    assert pairs["stall"] == pytest.approx([1.4 / 1.2, 1.1 / 1.0])  # saves 2..N
    assert pairs["persist"] == pytest.approx([1.9 / 2.0, 2.0 / 2.5])  # the faster raw write (buffered here)
    assert pairs["restore_cold"] == pytest.approx([1.0, 0.5])
    assert pairs["snapshot"] == pytest.approx([1.3 / 1.2, 1.0 / 1.0])  # the copy inside the save alone
    assert pairs["restore_cold_cap"] == pytest.approx([0.8, 0.8])  # raw ÷ the same read verified
    assert pairs["restore_cold_verified"] == pytest.approx([1.25, 0.625])  # verified ÷ ours
    run2 = {"worlds": {"2": {"ranks": [rank([9, 1.0, 1.0], [1, 1, 1], [1, 1, 1], [9, 2, 2], [1, 2, 2],
                                            [(1.0, 1.0)])]}, "1": {"ranks": []}}}
    pooled = {p.target: p for p in pool_runs.pool([run1, run2])}  # only world 2 is in both
    stall = pooled["stall"]
    assert stall.world == "2" and stall.pairs == 4
    assert stall.median == pytest.approx(statistics.median([1.4 / 1.2, 1.1, 1.0, 1.0]))
    assert stall.runs == pytest.approx((statistics.median([1.4 / 1.2, 1.1]), 1.0))
    assert stall.low <= stall.median <= stall.high and stall.met  # 1.05 ≤ 1.10
    assert pool_runs.pool([run1, run2]) == pool_runs.pool([run1, run2])  # the same input, the same intervals
    assert pooled["persist"].median == pytest.approx(0.975) and pooled["persist"].met
    assert pooled["restore_cold"].pairs == 3 and pooled["restore_cold"].median == pytest.approx(1.0)
    assert pooled["restore_cold_cap"].met is None and pooled["snapshot"].met is None  # informative
    table = pool_runs.markdown(list(pooled.values()), ["A", "B"])
    assert table.count("\n") == 2 + len(pooled) and "| A | B |" in table
    assert "| - | - |" in table and "| ≥ 0.90 | yes |" in table


def test_every_timed_restore_starts_from_freshly_freed_memory(monkeypatch):
    """This VM reports free memory to its host, which takes it back: 1 GiB of fresh pages took
    0.9-1.6 s to fill after a few idle seconds, 0.18 s right after another 1 GiB was freed. So before
    every timed restore (ours, the raw read, the peers: all call ``before_load``) the harness touches
    and frees the restore's bytes, and whichever contender runs next finds recycled pages."""
    monkeypatch.syspath_prepend(BENCHMARKS)
    import resource

    import torch

    import _common

    state = {"a": torch.ones(4 << 20, dtype=torch.uint8), "b": {"c": torch.ones(1 << 20, dtype=torch.uint8)}}
    ctx = _common.RankCtx(0, 1, state, "/nonexistent", reps=1, peer_reps=1)
    primed: list[int] = []
    prime = _common.prime_free_memory
    monkeypatch.setattr(_common, "prime_free_memory", lambda n: (primed.append(n), prime(n))[1])
    rss = _common.rss_bytes()
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    ctx.before_load()
    assert primed == [5 << 20]
    # the bytes were touched (at least a fault per 2 MiB page of them) and handed back
    assert resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults >= (5 << 20) // (2 << 20)
    assert _common.rss_bytes() - rss < (4 << 20)


def test_each_restore_round_times_one_raw_read_into_the_faster_memory_chosen_once(monkeypatch, tmp_path):
    """Runs up to 2026-11-26 took, in every round, the faster of a raw read into 4 KiB pages and one into
    huge pages: a best of two against a single ``load()``, so a stall of the raw read counted only where
    it hit both of its reads (ours: 2-6 of 10 rounds per run). The kind of memory is chosen once,
    before the rounds; each round then times one of each."""
    monkeypatch.syspath_prepend(BENCHMARKS)
    import bench_save

    ctx = bench_save.RankCtx(0, 1, {}, str(tmp_path), reps=4, peer_reps=1)
    with open(ctx.path("raw-0.bin"), "wb") as f:
        f.write(b"x" * 4096)
    speed = {bench_save._plain_pages: 2.0, bench_save._huge_pages: 1.0}  # huge pages read faster here
    reads: list[tuple[bool, object]] = []

    def read_fresh(ctx, paths, nbytes, cold, allocate, verify_step=None):
        reads.append((cold, allocate, verify_step))
        return speed[allocate] * (1.0 if verify_step is None else 1.125)  # checking every byte costs 1/8 here

    monkeypatch.setattr(bench_save, "read_fresh", read_fresh)
    monkeypatch.setattr(bench_save, "set_page_cache", lambda *a, **k: None)
    monkeypatch.setattr(bench_save, "timed", lambda fn: (1.25, fn()))
    out = bench_save.paired_restores(ctx, lambda: None)
    chosen = reads[10:]  # after 5 warm reads of each kind, alternated
    assert [(cold, a is bench_save._huge_pages, v) for cold, a, v in reads[:10]] == \
        [(False, False, None), (False, True, None)] * 5
    # per round one raw read and one verified the way load() verifies (1 MiB requests), in rotating order
    rounds = [chosen[i:i + 2] for i in range(0, len(chosen), 2)]
    assert [sorted(v or 0 for _, _, v in r) for r in rounds] == [[0, 1 << 20]] * 8
    assert [{cold for cold, _, _ in r} for r in rounds] == [{True}] * 4 + [{False}] * 4
    assert [r[0][2] for r in rounds[:3]] == [None, 1 << 20, 1 << 20]  # raw, ours, verified; ours, verified, raw; ...
    assert all(a is bench_save._huge_pages for _, a, _ in chosen)
    assert out["restore_raw_huge_pages"] == 1.0
    assert out["restore_vs_raw_cold_median"] == out["restore_vs_raw_warm_median"] == 1.25
    assert out["restore_vs_verified_warm_median"] == pytest.approx(1.25 / 1.125)
    assert out["verified_vs_raw_cold_median"] == pytest.approx(1.125)
    assert {out[f"restore_warm_{i}_verified_s"] for i in range(1, 5)} == {1.125}


def test_every_rank_reads_into_the_kind_of_memory_faster_summed_over_the_ranks(monkeypatch, tmp_path):
    """With the choice made per rank, one rank of a run picked 4 KiB pages (3-5 x slower here) from
    a noisy sample and its restore target read 2.6 x: the ranks add their medians and all take the
    lower sum."""
    monkeypatch.syspath_prepend(BENCHMARKS)
    import bench_save
    import torch

    summed = {"plain": 0.0, "huge": 0.0}

    def all_reduce(t):  # the other rank measured huge pages 1.0 s slower, 4 KiB pages as fast as this one
        t += torch.tensor([0.5, 1.0], dtype=torch.float64)
        summed.update(plain=float(t[0]), huge=float(t[1]))

    speed = {bench_save._plain_pages: 0.5, bench_save._huge_pages: 0.2}
    monkeypatch.setattr(bench_save, "read_fresh", lambda ctx, paths, nbytes, cold, allocate: speed[allocate])
    monkeypatch.setattr(bench_save.dist, "all_reduce", all_reduce)
    ctx = bench_save.RankCtx(0, 2, {}, str(tmp_path), reps=1, peer_reps=1)
    assert bench_save.faster_memory(ctx, [], 0) is bench_save._plain_pages  # 1.0 s against 1.2 s
    assert summed == {"plain": 1.0, "huge": 1.2}


def test_the_verified_raw_read_reads_the_same_bytes_in_steps_on_every_thread(monkeypatch, tmp_path):
    """The cap of the restore target is a raw read that hashes every request as ``load()`` does:
    it must read every byte into its place, whatever the steps and the threads' shares."""
    monkeypatch.syspath_prepend(BENCHMARKS)
    from _common import read_into

    data = [os.urandom(n) for n in (3 * 4096 + 17, 1, 5 * 4096)]
    paths = []
    for i, blob in enumerate(data):
        paths.append(str(tmp_path / f"raw-{i}.bin"))
        with open(paths[-1], "wb") as f:
            f.write(blob)
    whole = b"".join(data)
    for threads in (1, 2, 3):
        for step in (None, 4096, 1000):
            dest = bytearray(len(whole))
            assert read_into(paths, memoryview(dest), threads, step) == len(whole)
            assert bytes(dest) == whole, (threads, step)


# ---- bench_lightning's Transformer section: the node-memory level against a slow disk ---------------
def test_the_slow_disk_passes_a_flush_stream_through_unchanged_and_takes_bytes_over_rate(monkeypatch, tmp_path):
    """A flush streams views of one reused buffer: a slow disk that kept them (list()) wrote the last
    chunk over and over, and the disk copy failed its checksums only when read back."""
    import time

    import torch

    monkeypatch.syspath_prepend(BENCHMARKS)
    from _slow_storage import SLOW, SlowStorage, throttle
    from ckpt_engine import Checkpointer

    monkeypatch.setattr("_slow_storage.SLOW", dict(SLOW))
    import _slow_storage

    throttle(200)  # MB/s
    state = {"w": torch.arange(5_000_000, dtype=torch.float32)}  # 20 MB: three 8 MiB chunks of a flush
    ck = Checkpointer(levels=[{"kind": "memory", "path": str(tmp_path / "mem"), "job": "j"},
                              SlowStorage(str(tmp_path / "disk"))])
    start = time.perf_counter()
    ck.save(state, 1)
    ck.wait(flush=True)
    took = time.perf_counter() - start
    ck.close()
    assert _slow_storage.SLOW["bytes"] == 20_000_000 and took >= 20e6 / 200e6
    assert torch.equal(Checkpointer(str(tmp_path / "disk"), readonly=True).load()["w"], state["w"])
    assert not (tmp_path / "mem" / "j").exists()


def _fit(contender, process_cpu, fit_wall, end_wall, train_cpu_ms, threads, figures=(), copy_hash=(), steps=20):
    from _lightning_job import FitResult

    marks = [(0.25 * i, 0.25 * i, 0.25 * i) for i in range(1, steps + 1)]
    return FitResult(contender=contender, rep=0, process_cpu_s=process_cpu, process_wall_s=fit_wall + 2,
                     fit_cpu_s=process_cpu - 2, fit_wall_s=fit_wall, main_cpu_s=process_cpu - sum(threads.values()),
                     threads_cpu_s=threads, n_ckpt=len(train_cpu_ms), train_cpu_ms=list(train_cpu_ms),
                     figures=list(figures), params=14_600_000, save_steps=list(range(1, len(train_cpu_ms) + 1)),
                     marks=marks, end_wall_s=end_wall, counters={"flushed": 1, "flush_skipped": 1},
                     copy_hash=list(copy_hash))


def _saves(steps):
    return [{"kind": "save", "step": s, "committed": True, "stall_ms": 5.0, "encode_cpu_ms": 1.0,
             "snapshot_cpu_ms": 10.0, "persist_cpu_ms": 5.0, "commit_cpu_ms": 0.0, "train_cpu_ms": 20.0}
            for s in steps] + [{"kind": "flush", "step": steps[-1], "committed": True, "lag_ms": 900.0,
                                "copy_ms": 800.0}]


def test_the_memory_section_holds_each_target_against_its_own_figure(monkeypatch):
    monkeypatch.syspath_prepend(BENCHMARKS)
    import bench_lightning
    from _lightning_job import FitJob

    job = FitJob(steps=20, every=10, threads=1)
    fits = [_fit("none", 10.0, 5.0, 5.0, [], {}),
            _fit("ours_disk50", 10.5, 9.0, 8.0, [20.0] * 2, {"ckpt-persist": 0.02}, _saves([10, 20])),
            _fit("ours_mem", 10.2, 5.1, 5.05, [10.0] * 2, {"ckpt-flush-1": 0.1}, _saves([10, 20])),
            # own CPU per checkpoint: 20 ms on the training thread + 40 ms of threads = 60 ms, 2 x the floor
            _fit("ours_mem_every1", 11.5, 6.0, 5.5, [20.0] * 19, {"ckpt-persist": 19 * 0.04}, _saves(range(2, 21))),
            _fit("copy_hash_every1", 10.6, 5.2, 5.2, [30.0] * 20, {}, copy_hash=[(0.04, 0.03)] * 20)]
    summary = bench_lightning.summarize(job, fits, [f.contender for f in fits])
    text = "\n".join(bench_lightning.markdown(summary))
    assert "## Node-memory level in front of a 50 MB/s disk" in text
    assert "whole process +2.0 % → PASS" in text  # 10.2 s against 10.0 s
    assert "fit +2.0 % → PASS" in text and "training alone (up to `on_train_end`) +1.0 % → PASS" in text
    assert "ours (memory + disk) 60.0 ms vs copy + xxh3 30.0 ms per step" in text and "2.00 × → FAIL" in text
    assert "0 of 1 fits left files" in text
    again = bench_lightning.resummarize({"summary": summary, "fits": [f.as_json() for f in fits]})
    assert "\n".join(bench_lightning.markdown(again["summary"])) == text


# ---- paired overheads (_fit_figures): each fit against the no-checkpointing fit of its round ----------
def _round_fit(name, rep, cpu, wall, own=0.0, saves=0):
    from _lightning_job import FitResult

    return FitResult(contender=name, rep=rep, process_cpu_s=cpu, process_wall_s=wall, fit_cpu_s=cpu, fit_wall_s=wall,
                     main_cpu_s=cpu - own, threads_cpu_s={"ckpt-persist": own} if own else {}, n_ckpt=saves,
                     train_cpu_ms=[], end_wall_s=wall)


def test_an_overhead_is_paired_with_its_own_round_and_inside_the_noise_when_the_rounds_disagree(monkeypatch):
    """The machine drifts between rounds (here 40 % from one to the next): each fit is taken against the
    no-checkpointing fit of its own round. 10 % in one round and 0 % in the next is 5 ± 5 %, inside the
    noise; 9, 10 and 11 % in three rounds is not."""
    monkeypatch.syspath_prepend(BENCHMARKS)
    from _fit_figures import PAIRED, Paired, paired

    drifting = [_round_fit("none", 0, 10.0, 5.0), _round_fit("ours", 0, 11.0, 5.0),
                _round_fit("none", 1, 14.0, 7.0), _round_fit("ours", 1, 14.0, 7.0)]
    p = paired(drifting, "ours", PAIRED["process_cpu"][1])
    assert p.values == pytest.approx((0.10, 0.0)) and p.median == pytest.approx(0.05)
    assert p.se == pytest.approx(0.05) and p.noise and p.text().endswith("(noise)")
    steady = [f for r, base in enumerate((10.0, 20.0, 30.0))
              for f in (_round_fit("none", r, base, 5.0), _round_fit("ours", r, base * (1.1 + (r - 1) / 100), 5.0))]
    p = paired(steady, "ours", PAIRED["process_cpu"][1])
    assert p.mean == pytest.approx(0.10) and not p.noise and "(noise)" not in p.text()
    assert Paired.of(p.as_json()) == p
    one_round = paired(drifting[:2], "ours", PAIRED["process_cpu"][1])
    assert one_round.noise and one_round.se != one_round.se  # one round: no error, never outside the noise


def test_the_checkpoint_threads_cpu_and_the_rest_add_up_to_the_process_cpu(monkeypatch):
    monkeypatch.syspath_prepend(BENCHMARKS)
    from _fit_figures import PAIRED, paired

    fits = [_round_fit("none", 0, 10.0, 5.0, own=0.1), _round_fit("ours", 0, 11.5, 5.5, own=0.9, saves=3)]
    own, rest, total = (paired(fits, "ours", PAIRED[k][1]).median for k in ("own_cpu", "rest_cpu", "process_cpu"))
    assert own == pytest.approx(0.08) and rest == pytest.approx(0.07) and own + rest == pytest.approx(total)


def test_bench_horovod_draws_no_ratio_from_a_peer_inside_the_noise(monkeypatch):
    monkeypatch.syspath_prepend(BENCHMARKS)
    import argparse

    import bench_horovod

    def fits(peer):  # three rounds; ours +1 % of CPU, the peer `peer` (per round)
        return [f for r, base in enumerate((10.0, 12.0, 11.0)) for f in (
            _round_fit("none", r, base, 5.0), _round_fit("torch_save", r, base * (1 + peer[r]), 5.0, saves=6),
            _round_fit("ours", r, base * 1.01, 5.0, own=0.05, saves=6),
            _round_fit("ours_memory", r, base * 1.01, 5.0, own=0.05, saves=6))]

    a = argparse.Namespace(ranks=2, steps=60, every=10, rounds=3)
    text, rows = bench_horovod.markdown(fits([0.05, 0.06, 0.04]), a, "Run 2026-01-01, test")
    assert "process CPU, ours, disk: +1.0 / +1.0 ± 0.0 %" in text and "0.20 × the peer → PASS (target ≤ 0.33)" in text
    assert rows["ours"]["paired"]["process_cpu"]["rounds"] == 3
    text, _ = bench_horovod.markdown(fits([0.05, -0.04, 0.0]), a, "Run 2026-01-01, test")
    assert "process CPU, ours, disk" in text and "inconclusive: the peer's difference is inside the noise" in text
    text, _ = bench_horovod.markdown(fits([-0.05, -0.06, -0.04]), a, "Run 2026-01-01, test")
    assert "no ratio: the peer's difference is not above zero" in text

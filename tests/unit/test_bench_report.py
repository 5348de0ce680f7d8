"""bench/report.py: the benchmarks page and README's headline block show the figures of the
results files, every ratio the median of per-run ratios, and each file's standing against the
history. Pure: no Redis, no Postgres; git on the repository and on a tiny repository of its
own."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load(name: str) -> ModuleType:
    """bench/<name>.py as a module; bench/ on sys.path only meanwhile (report.py imports
    ratios.py beside it), so that no bench module shadows another import later."""
    saved = list(sys.path)
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up there
        spec.loader.exec_module(module)
    finally:
        sys.path[:] = saved
    return module


report = _load("report")
ratios = _load("ratios")


# --- the committed page and README block are what the results files say ---------------------
def test_the_committed_page_is_its_regeneration() -> None:
    """A figure edited by hand on the page (or a results file changed without regenerating)
    fails here: regenerate with `make bench-report`."""
    as_of = report.committed_as_of()
    assert as_of is not None, "docs/benchmarks.md names no as-of commit: make bench-report"
    page, _ = report.generate(as_of=as_of)
    assert report.PAGE.read_text() == page, "docs/benchmarks.md is stale: make bench-report"


def test_the_readme_block_is_its_regeneration() -> None:
    readme = report.README.read_text()
    # the README's headline figures live between the markers: without them nothing checks them
    assert report.START in readme and report.END in readme, (
        "README.md lost its bench-report markers"
    )
    _, block = report.generate(as_of=report.committed_as_of())
    assert report.readme_with(readme, block) == readme, "README's block: make bench-report"


def test_the_headline_figures_are_the_files_per_run_ratios() -> None:
    """Independently of the renderer: each headline set's ratios, without and with the
    persister, computed here from its runs, are on the page as the headline shows them."""
    page = report.PAGE.read_text()
    block = page.split("## Headline", 1)[1].split("## ", 1)[0]
    for stem in report.HEADLINE:
        data = json.loads((report.RESULTS / f"{stem}.json").read_text())
        for system in ("jobtier", "jobtier-persist"):
            got = ratios.per_run_ratios(data["runs"], system, "bullmq", "everysec")
            assert len(got) == len(data["runs"])
            shown = f"**{ratios.median_ratio(got):.2f}\N{MULTIPLICATION SIGN}** ("
            assert shown + ", ".join(f"{r:.2f}" for r in got) + ")" in block
        assert f"`{data['command']}`" in block


# --- the median of per-run ratios -----------------------------------------------------------
def _runs(pairs: Sequence[tuple[float | None, float | None]]) -> list[dict[str, Any]]:
    def one(rate: float | None) -> dict[str, Any]:
        return {"error": "boom"} if rate is None else {"e2e_jobs_per_s": rate}

    return [{"jobtier": {"everysec": one(a)}, "bullmq": {"everysec": one(b)}} for a, b in pairs]


def test_a_ratio_is_the_median_of_per_run_ratios_not_a_ratio_of_medians() -> None:
    # a fast spell in run 1 for jobtier, in run 3 for BullMQ: medians 200 and 100 (2.0x),
    # per run 3.0, 2.0, 0.5, 1.0 and 1.5 -> median 1.5x
    runs = _runs([(300, 100), (200, 100), (100, 200), (150, 150), (150, 100)])
    got = ratios.per_run_ratios(runs, "jobtier", "bullmq", "everysec")
    assert got == [3.0, 2.0, 0.5, 1.0, 1.5]
    assert ratios.median_ratio(got) == 1.5


def test_a_run_where_either_failed_is_left_out() -> None:
    runs = _runs([(100, 50), (None, 50), (100, None), (100, 0), (90, 100)])
    got = ratios.per_run_ratios(runs, "jobtier", "bullmq", "everysec")
    assert got == [2.0, 0.9]
    assert ratios.median_ratio([]) is None
    assert ratios.per_run_ratios(runs, "jobtier", "saq", "everysec") == []


# --- the stale check on a tiny history ------------------------------------------------------
def _git(repo: Path, *args: str) -> str:
    done = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def _commit(repo: Path, path: str, text: str) -> str:
    (repo / path).parent.mkdir(parents=True, exist_ok=True)
    (repo / path).write_text(text)
    _git(repo, "add", path)
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", path)
    return _git(repo, "rev-parse", "--short=7", "HEAD")


def _save(results: Path, stem: str, commit: str | None, extra: dict[str, Any]) -> None:
    env = {"command": f"python bench/{stem}.py", "date": "2026-12-02T00:00:00Z",
           "machine": {"nproc": 2, "cpu": "Test CPU", "platform": "Linux-6.1-x86_64-with",
                       "load_average_at_start": [0.1, 0.2, 0.3]}}  # fmt: skip
    if commit is not None:
        env["commit"] = commit
    (results / f"{stem}.json").write_text(json.dumps({**env, **extra}))


@pytest.fixture
def history(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """A repository where `fake` measures src/measured.py: c1 measured, c2 touches another
    file, c3 changes the measured one."""
    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q")
    c1 = _commit(repo, "src/measured.py", "one\n")
    c2 = _commit(repo, "src/other.py", "other\n")
    c3 = _commit(repo, "src/measured.py", "two\n")
    monkeypatch.setattr(report, "MEASURES", {"fake": ("src/measured.py",)})

    def git(args: Sequence[str]) -> str | None:
        done = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True)
        return done.stdout if done.returncode == 0 else None

    results = tmp_path / "results"
    results.mkdir()
    return {"repo": repo, "git": git, "results": results, "c1": c1, "c2": c2, "c3": c3}


def test_a_file_is_stale_once_a_later_commit_changes_what_it_measures(
    history: dict[str, Any],
) -> None:
    results, git = history["results"], history["git"]
    _save(results, "fake", history["c1"], {})
    _save(results, "fake-after-other", history["c2"], {})
    _save(results, "fake-local", f"{history['c3']}+local changes", {})
    _save(results, "fake-lost", "07d5cde", {})
    _save(results, "fake-unsigned", None, {})
    got = {r.stem: r for r in report.load(results, "HEAD", git)}
    assert got["fake"].stale and got["fake"].changed_by == [history["c3"]]
    assert got["fake"].status.startswith("STALE: 1 later commit changed the measured path")
    assert got["fake-after-other"].stale  # c3 is after c2 too
    assert got["fake-local"].status == "current" and got["fake-local"].local
    assert "+local" in got["fake-local"].label
    assert got["fake-lost"].status == "unbacked: commit not in history"
    assert got["fake-unsigned"].status == "unbacked: no commit recorded"
    # as of c2, the file measured at c1 was still current (another path changed)
    as_of_c2 = {r.stem: r for r in report.load(results, history["c2"], git)}
    assert as_of_c2["fake"].status == "current"


def test_the_newest_change_is_named_by_seven_digits_whatever_the_clone_abbreviates(
    history: dict[str, Any],
) -> None:
    """git's %h grows with the number of objects in the clone (8 digits in a busy one, 7 in a
    fresh one): the pages must not depend on it, or a fresh clone regenerates them otherwise."""
    _git(history["repo"], "config", "core.abbrev", "12")
    assert len(_git(history["repo"], "log", "-1", "--format=%h")) == 12
    _save(history["results"], "fake", history["c1"], {})
    (got,) = report.load(history["results"], "HEAD", history["git"])
    assert got.changed_by == [history["c3"]] and len(history["c3"]) == 7
    assert f"(newest `{history['c3']}`)" in got.status


def test_merging_main_into_a_branch_does_not_make_its_measurements_stale(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A branch that merged main, then main measured, then the branch merged main again: the
    first merge differs from the branch's side on the measured path (it brought main's change
    in, from before the measurement) but changes nothing of its own."""
    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q", "-b", "main")
    _commit(repo, "src/measured.py", "one\n")
    _git(repo, "checkout", "-q", "-b", "side")
    _commit(repo, "docs/page.md", "docs\n")
    _git(repo, "checkout", "-q", "main")
    _commit(repo, "src/measured.py", "two\n")
    merge = ["-c", "user.name=t", "-c", "user.email=t@t", "merge", "-q", "--no-edit", "main"]
    _git(repo, "checkout", "-q", "side")
    _git(repo, *merge)
    _git(repo, "checkout", "-q", "main")
    measured = _commit(repo, "bench/results/fake.md", "measured here\n")
    _git(repo, "checkout", "-q", "side")
    _git(repo, *merge)
    monkeypatch.setattr(report, "MEASURES", {"fake": ("src/measured.py",)})

    def git(args: Sequence[str]) -> str | None:
        done = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True)
        return done.stdout if done.returncode == 0 else None

    results = tmp_path / "results"
    results.mkdir()
    _save(results, "fake", measured, {})
    (got,) = report.load(results, "HEAD", git)
    assert got.status == "current", got.status
    later = _commit(repo, "src/measured.py", "three\n")
    (got,) = report.load(results, "HEAD", git)
    assert got.stale and got.changed_by == [later]


def test_the_page_shows_each_files_provenance_and_standing(history: dict[str, Any]) -> None:
    results = history["results"]
    _save(results, "fake", history["c1"], {})
    (results / "fake-printed.md").write_text("# printed only\n")
    page, block = report.generate(results, as_of="HEAD", git=history["git"])
    row = next(line for line in page.splitlines() if line.startswith("| `fake` |"))
    assert "`python bench/fake.py`" in row and history["c1"] in row
    assert "2026-12-02T00:00:00Z" in row and "2 CPUs Test CPU" in row and "STALE" in row
    assert "`fake-printed.md`" in page  # a page with no .json is named as such
    assert "No headline results file" in block


def test_the_headline_takes_per_run_ratios_from_a_fake_set(
    history: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    results = history["results"]
    runs = _runs([(300, 100), (200, 100), (100, 200), (150, 150), (150, 100)])
    for run, persisted in zip(runs, (90, 80, 100, 120, 60), strict=True):
        run["jobtier-persist"] = {"everysec": {"e2e_jobs_per_s": persisted}}
    # the summary the file saved says 2.00x (a ratio of medians): the block must not
    summary = {"jobtier": {"everysec": {"e2e_jobs_per_s": 200.0, "e2e_vs_bullmq": 2.0}}}
    _save(results, "compare-fake", history["c3"], {"runs": runs, "summary": summary})
    monkeypatch.setattr(report, "HEADLINE", ("compare-fake",))
    monkeypatch.setattr(report, "MEASURES", {"compare": ("src/measured.py",)})
    _, block = report.generate(results, as_of="HEAD", git=history["git"])
    assert "**1.50\N{MULTIPLICATION SIGN}** (3.00, 2.00, 0.50, 1.00, 1.50)" in block
    assert "**0.80\N{MULTIPLICATION SIGN}** (0.90, 0.80, 0.50, 0.80, 0.60)" in block
    assert "2.00\N{MULTIPLICATION SIGN}" not in block
    assert "`python bench/compare-fake.py`" in block and "current" in block


# --- README's block ---------------------------------------------------------------------------
def test_the_readme_block_is_replaced_between_its_markers_only() -> None:
    text = f"# jobtier\n\nbefore\n{report.START}\nold 1.285\n{report.END}\nafter\n"
    assert report.readme_with(text, "new 1.188\n") == (
        f"# jobtier\n\nbefore\n{report.START}\n\nnew 1.188\n\n{report.END}\nafter\n"
    )
    again = report.readme_with(report.readme_with(text, "new\n"), "new\n")
    assert again == report.readme_with(text, "new\n")  # regenerating changes nothing
    assert report.readme_with("# no markers\n", "x") is None
    assert report.readme_with(f"{report.END}\n{report.START}\n", "x") is None


def test_the_command_fills_readme_markers_and_check_catches_a_hand_edit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    readme, page = tmp_path / "README.md", tmp_path / "docs" / "benchmarks.md"
    readme.write_text(f"# jobtier\n\n{report.START}\nold figures\n{report.END}\n\nmore\n")
    monkeypatch.setattr(report, "README", readme)
    monkeypatch.setattr(report, "PAGE", page)
    assert report.main([]) == 0
    assert "rewrote README.md's bench-report block" in capsys.readouterr().out
    text = readme.read_text()
    assert "old figures" not in text and text.endswith(f"{report.END}\n\nmore\n")
    assert "jobtier with its persister vs BullMQ" in text
    assert report.main(["--check"]) == 0
    figure = re.search(r"\*\*(\d\.\d\d)\N{MULTIPLICATION SIGN}\*\*", text)
    assert figure is not None
    readme.write_text(text.replace(figure.group(0), "**9.99\N{MULTIPLICATION SIGN}**", 1))
    assert report.main(["--check"]) == 1
    assert "README.md's bench-report block differs" in capsys.readouterr().err
    readme.write_text("# no markers\n")
    assert report.main([]) == 0
    assert "no <!-- bench-report:start -->" in capsys.readouterr().out
    assert readme.read_text() == "# no markers\n"


def test_compare_summarises_each_ratio_as_the_median_of_per_run_ratios() -> None:
    """bench/compare.py's own summary (what it prints and saves), not only this page."""
    compare = _load("compare")
    runs = _runs([(300, 100), (200, 100), (100, 200), (150, 150), (110, 100)])
    for run, saq in zip(runs, (50, 40, 50, 30, 60), strict=True):
        run["saq"] = {"everysec": {"e2e_jobs_per_s": saq}}
    for run in runs:  # the other fields compare.py takes medians of
        for modes in run.values():
            for fields in modes.values():
                fields.update({f: 1.0 for f in compare.FIELDS if f != "e2e_jobs_per_s"})
    s = compare.summarise(runs)["jobtier"]["everysec"]
    assert s["e2e_vs_bullmq_runs"] == pytest.approx([3.0, 2.0, 0.5, 1.0, 1.1])
    assert s["e2e_vs_bullmq"] == pytest.approx(1.1)
    assert s["e2e_vs_bullmq_of_medians"] == 1.5  # 150 / 100: kept, under its own name
    assert s["e2e_vs"]["saq"]["runs"] == pytest.approx([6.0, 5.0, 2.0, 5.0, 110 / 60])
    assert s["e2e_vs"]["saq"]["median"] == 5.0
    assert "e2e_vs" not in compare.summarise(runs)["saq"]["everysec"]  # jobtier's rows only

"""Every file under ``bench/results/`` is cited by ``bench/RESULTS.md``: by its path
relative to ``bench/results/`` (its file name where that is unique), or by a directory of
it named there with a trailing slash. An uncited file is a figure nobody reads, or one
whose table was dropped."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results"


def uncited(results: Path, text: str) -> list[str]:
    """Paths under ``results`` (relative, sorted) that ``text`` does not cite."""
    out = []
    for path in sorted(p for p in results.rglob("*") if p.is_file()):
        rel = path.relative_to(results)
        parents = [f"{parent.as_posix()}/" for parent in rel.parents if parent != Path(".")]
        if f"`{rel.name}`" in text or rel.as_posix() in text:
            continue
        if any(f"`{d}`" in text for d in parents):
            continue
        out.append(rel.as_posix())
    return out


def test_every_result_file_is_cited() -> None:
    text = (ROOT / "bench" / "RESULTS.md").read_text()
    missing = uncited(RESULTS, text)
    assert not missing, f"bench/results/ files RESULTS.md does not cite: {missing}"


def test_an_uncited_file_is_found(tmp_path: Path) -> None:
    (tmp_path / "cited.json").write_text("{}")
    (tmp_path / "stray.json").write_text("{}")
    (tmp_path / "study").mkdir()
    (tmp_path / "study" / "a.log").write_text("")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "b.log").write_text("")
    text = "see `cited.json` and `study/`"
    assert uncited(tmp_path, text) == ["other/b.log", "stray.json"]

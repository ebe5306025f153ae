import hashlib
import io
from pathlib import Path

import pytest

from fedsilo import datafetch
from fedsilo.datafetch import DataError, default_data_root, ensure, read_manifest
from fedsilo.tasks.text2sql.data import DataError as Text2SqlDataError

FILES = {"a.json": b'[{"x": 1}]\n', "sub/b-schema.csv": b"Table Name, Field Name\nT, C\n"}


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture
def mirror(tmp_path):
    """A data root holding ``toy/<file>`` plus a manifest describing the files."""
    root = tmp_path / "mirror"
    for rel, data in FILES.items():
        (root / "toy" / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / "toy" / rel).write_bytes(data)
    manifest = tmp_path / "sources.tsv"
    rows = ["path\tsize\tsha256\trepo\tpath_in_repo\tcommit"]
    rows += [f"{rel}\t{len(data)}\t{_sha(data)}\towner/repo\tdata/{rel}\t{'0' * 40}" for rel, data in FILES.items()]
    manifest.write_text("\n".join(rows) + "\n")
    return root, manifest


@pytest.fixture(autouse=True)
def no_network(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("tests must not download")
    monkeypatch.setattr(datafetch.urllib.request, "urlopen", refuse)


def test_copies_and_verifies(mirror, tmp_path):
    root, manifest = mirror
    dest = tmp_path / "dest"
    assert ensure("toy", dest, mirror=root, manifest=manifest, progress=False) == dest
    for rel, data in FILES.items():
        assert (dest / rel).read_bytes() == data
    assert sorted(p.name for p in dest.rglob("*")) == ["a.json", "b-schema.csv", "sub"]  # no temp files left


def test_mirror_may_hold_files_directly(mirror, tmp_path):
    root, manifest = mirror
    ensure("toy", tmp_path / "dest", mirror=root / "toy", manifest=manifest, progress=False)
    assert (tmp_path / "dest" / "a.json").read_bytes() == FILES["a.json"]


def test_corrupted_mirror_file_raises_and_leaves_nothing(mirror, tmp_path):
    root, manifest = mirror
    (root / "toy" / "a.json").write_bytes(b"tampered")
    dest = tmp_path / "dest"
    with pytest.raises(DataError) as err:
        ensure("toy", dest, mirror=root, manifest=manifest, progress=False)
    msg = str(err.value)
    assert "a.json" in msg and _sha(FILES["a.json"]) in msg and _sha(b"tampered") in msg
    assert not (dest / "a.json").exists()
    assert list(dest.iterdir()) == []  # the temp file is cleaned up too


def test_present_correct_file_is_not_recopied(mirror, tmp_path):
    root, manifest = mirror
    dest = tmp_path / "dest"
    ensure("toy", dest, mirror=root, manifest=manifest, progress=False)
    before = (dest / "a.json").stat().st_mtime_ns
    (root / "toy" / "a.json").unlink()  # a re-copy would now have to download: refused above
    ensure("toy", dest, mirror=root, manifest=manifest, progress=False)
    assert (dest / "a.json").stat().st_mtime_ns == before


def test_wrong_present_file_is_replaced(mirror, tmp_path):
    root, manifest = mirror
    dest = tmp_path / "dest"
    dest.mkdir()
    (dest / "a.json").write_bytes(b"old version")
    ensure("toy", dest, mirror=root, manifest=manifest, progress=False)
    assert (dest / "a.json").read_bytes() == FILES["a.json"]


def test_bad_manifest_row(tmp_path):
    manifest = tmp_path / "sources.tsv"
    manifest.write_text("path\tsize\tsha256\trepo\tpath_in_repo\tcommit\na.json\tbig\tabc\n")
    with pytest.raises(DataError, match=r"sources\.tsv: line 2"):
        read_manifest(manifest)


def test_text2sql_manifest_ships_with_package():
    sources = read_manifest(Path(datafetch.__file__).parent / "tasks" / "text2sql" / "sources.tsv")
    names = {s.path for s in sources}
    assert {"atis.json", "geography.json", "geography-db.added-in-2020.sqlite", "yelp-schema.csv"} <= names
    atis = next(s for s in sources if s.path == "atis.json")
    assert atis.url == ("https://raw.githubusercontent.com/jkkummerfeld/text2sql-data/"
                        "5050bad2309a93636ea4788d3660c9202bf11e0e/data/atis.json")


def test_default_data_root(monkeypatch, tmp_path):
    monkeypatch.setenv("FEDSILO_DATA", str(tmp_path))
    assert default_data_root() == tmp_path
    monkeypatch.delenv("FEDSILO_DATA")
    assert default_data_root() == Path.home() / ".cache" / "fedsilo" / "data"


def test_mirror_env_is_used(mirror, tmp_path, monkeypatch):
    root, manifest = mirror
    monkeypatch.setenv("FEDSILO_DATA_MIRROR", str(root))
    ensure("toy", tmp_path / "dest", manifest=manifest, progress=False)
    assert (tmp_path / "dest" / "a.json").exists()


def test_one_error_type():
    assert Text2SqlDataError is DataError and issubclass(DataError, ValueError)


def test_download_path_with_fake_urlopen(mirror, tmp_path, monkeypatch):
    """Exercises the download branch offline: urlopen is replaced by an in-memory response."""
    _, manifest = mirror
    seen = []

    def fake_urlopen(url, timeout):
        seen.append(url)
        return io.BytesIO(FILES[url.split("/data/", 1)[1]])

    monkeypatch.setattr(datafetch.urllib.request, "urlopen", fake_urlopen)
    monkeypatch.setattr(datafetch, "find_mirror", lambda: None)
    ensure("toy", tmp_path / "dest", manifest=manifest, progress=False)
    assert (tmp_path / "dest" / "sub" / "b-schema.csv").read_bytes() == FILES["sub/b-schema.csv"]
    assert seen[0] == f"https://raw.githubusercontent.com/owner/repo/{'0' * 40}/data/a.json"


def test_download_failure_is_a_data_error(mirror, tmp_path, monkeypatch):
    _, manifest = mirror

    def offline(url, timeout):
        raise OSError("network unreachable")

    monkeypatch.setattr(datafetch.urllib.request, "urlopen", offline)
    monkeypatch.setattr(datafetch, "find_mirror", lambda: None)
    with pytest.raises(DataError, match="cannot download a.json .*FEDSILO_DATA_MIRROR"):
        ensure("toy", tmp_path / "dest", manifest=manifest, progress=False)


def _mirror_only_manifest(tmp_path, data: bytes) -> Path:
    manifest = tmp_path / "mirror-only.tsv"
    manifest.write_text("path\tsize\tsha256\trepo\tpath_in_repo\tcommit\n"
                        f"ui/strings.tsv.gz\t{len(data)}\t{_sha(data)}\t-\t"
                        "built from Debian 12 packages' message catalogs; see docs/translation.md\t-\n")
    return manifest


def test_mirror_only_source_without_mirror_is_a_data_error(tmp_path, monkeypatch):
    """No public repository: never a download (urlopen refuses above), a pointed message instead."""
    manifest = _mirror_only_manifest(tmp_path, b"catalog\tde\ten\n")
    (source,) = read_manifest(manifest)
    assert source.mirror_only
    monkeypatch.setattr(datafetch, "find_mirror", lambda: None)
    with pytest.raises(DataError) as err:
        ensure("toy", tmp_path / "dest", manifest=manifest, progress=False)
    assert str(err.value) == ("ui/strings.tsv.gz has no public download (built from Debian 12 packages' message "
                              "catalogs; see docs/translation.md); set FEDSILO_DATA_MIRROR to a folder holding it")
    with pytest.raises(DataError, match="has no public download"):  # a mirror without the file: the same
        ensure("toy", tmp_path / "dest", mirror=tmp_path / "empty", manifest=manifest, progress=False)


def test_mirror_only_source_is_copied_from_a_mirror(tmp_path):
    data = b"catalog\tde\ten\n"
    manifest = _mirror_only_manifest(tmp_path, data)
    (tmp_path / "mirror" / "toy" / "ui").mkdir(parents=True)
    (tmp_path / "mirror" / "toy" / "ui" / "strings.tsv.gz").write_bytes(data)
    ensure("toy", tmp_path / "dest", mirror=tmp_path / "mirror", manifest=manifest, progress=False)
    assert (tmp_path / "dest" / "ui" / "strings.tsv.gz").read_bytes() == data

"""Local data sets: image folders, CSV and NPZ, with bad input skipped and counted."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from edge_agent.data import detect_format, load_dataset, sample_hash, split_dataset, split_indices
from edge_agent.errors import InputError
from edge_agent.int8.bundle import InputSpec
from edge_agent.sim.scenario import write_data

LABELS = ["cat", "dog", "owl"]
SPEC = InputSpec(shape=(1, 4, 4), scale=1 / 255.0)


def _png(path: Path, pixels: np.ndarray) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(pixels.astype(np.uint8), mode="L").save(path)


def _images(rng: np.random.Generator, n: int, size: int = 4) -> np.ndarray:
    return rng.integers(0, 256, (n, size, size))


def test_image_folder_resizes_down_normalises_and_counts_every_bad_file(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    good = _images(rng, 6)
    for i, img in enumerate(good[:3]):
        _png(tmp_path / "cat" / f"{i}.png", img)
    for i, img in enumerate(good[3:5]):
        _png(tmp_path / "dog" / f"{i}.png", img)
    _png(tmp_path / "dog" / "big.png", np.kron(good[5], np.ones((4, 4))))  # 16x16: resized, not skipped
    _png(tmp_path / "dog" / "tiny.png", good[4][:2, :3])  # 3x2: smaller than the input, skipped
    _png(tmp_path / "dog" / "copy.png", good[3])  # duplicate of dog/0.png
    (tmp_path / "dog" / "truncated.png").write_bytes((tmp_path / "cat" / "0.png").read_bytes()[:30])
    (tmp_path / "dog" / "zeros.png").write_bytes(bytes(200))
    (tmp_path / "dog" / "notes.txt").write_text("not an image")
    _png(tmp_path / "zebra" / "0.png", good[0] // 2)  # a label the model does not know
    (tmp_path / "owl").mkdir()  # a known label with no images
    buf = io.BytesIO()
    Image.fromarray(good[0].astype(np.uint8), mode="L").save(buf, format="JPEG")
    (tmp_path / "cat" / "photo.jpg").write_bytes(buf.getvalue())

    with pytest.raises(InputError, match=r"sub-folder\(s\) 'zebra' match none of the model's labels"):
        load_dataset(tmp_path, SPEC, LABELS)
    data = load_dataset(tmp_path, SPEC, LABELS, skip_unknown=True)
    rep = data.report
    assert rep.format == "images"
    assert len(data) == 7  # 3 cats + jpeg cat, 2 dogs + resized dog
    assert data.x.shape == (7, 1, 4, 4) and data.x.dtype == np.float32
    assert data.x.min() >= 0.0 and data.x.max() <= 1.0  # scale 1/255 applied
    first_cat = np.asarray(Image.open(tmp_path / "cat" / "0.png"), np.float32) / 255.0
    assert any(np.allclose(s[0], first_cat) for s in data.x)
    assert rep.skipped["unreadable-image"] == 2
    assert rep.skipped["duplicate"] == 1
    assert rep.skipped["not-an-image"] == 1
    assert rep.skipped["unknown-label"] == 1 and rep.unknown_labels == ["zebra"]
    assert rep.skipped["empty-class-folder"] == 1
    assert rep.skipped["too-small"] == 1 and any("tiny.png: too-small (3x2 is smaller" in e for e in rep.examples)
    assert rep.empty_classes == ["owl"]
    assert rep.per_class == {"cat": 4, "dog": 3, "owl": 0}
    assert any("truncated.png" in line for line in rep.examples)


def test_csv_reads_rows_and_skips_bad_ones(tmp_path: Path) -> None:
    header = ",".join([f"p{i}" for i in range(16)] + ["label"])
    row = ",".join(["10"] * 16)
    lines = [header,
             row + ",cat",
             ",".join(["20"] * 16) + ",dog",
             row.replace("10", "x", 1) + ",cat",  # non-numeric
             ",".join(["nan"] + ["1"] * 15) + ",dog",  # non-finite
             ",".join(["1"] * 15) + ",dog",  # a field short
             ",".join(["30"] * 16) + ",zebra",  # unknown label
             row + ",cat",  # duplicate
             ",".join(["40"] * 16) + ",owl", ""]
    path = tmp_path / "d.csv"
    path.write_text("\n".join(lines))
    data = load_dataset(path, SPEC, LABELS, skip_unknown=True)
    assert list(data.y) == [0, 1, 2]
    np.testing.assert_allclose(data.x[1], np.full((1, 4, 4), 20 / 255.0), rtol=1e-6)
    assert dict(data.report.skipped) == {"non-numeric": 1, "non-finite": 1, "wrong-size": 1,
                                        "unknown-label": 1, "duplicate": 1}
    assert data.report.seen == 8


@pytest.mark.parametrize("header, message", [
    ("a,b,label", "2 feature columns"),
    (",".join(f"p{i}" for i in range(16)) + ",class", "no label column 'label'"),
])
def test_csv_with_wrong_columns_is_a_clear_error(tmp_path: Path, header: str, message: str) -> None:
    path = tmp_path / "bad.csv"
    path.write_text(header + "\n1,2,3\n")
    with pytest.raises(InputError, match=message):
        load_dataset(path, SPEC, LABELS)


def test_csv_with_only_bad_rows_says_why(tmp_path: Path) -> None:
    path = tmp_path / "bad.csv"
    path.write_text(",".join([f"p{i}" for i in range(16)] + ["label"]) + "\n" + ",".join(["a"] * 16) + ",cat\n")
    with pytest.raises(InputError, match="no usable samples.*non-numeric: 1"):
        load_dataset(path, SPEC, LABELS)


def test_npz_shapes_labels_and_errors(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    x = rng.integers(0, 256, (5, 4, 4)).astype(np.uint8)  # (N, H, W) for one channel
    path = tmp_path / "d.npz"
    np.savez(path, x=x, y=np.array(["cat", "dog", "owl", "emu", "cat"]))
    data = load_dataset(path, SPEC, LABELS, skip_unknown=True)
    assert list(data.y) == [0, 1, 2, 0] and data.report.skipped["unknown-label"] == 1
    np.testing.assert_allclose(data.x[0, 0], x[0] / 255.0, rtol=1e-6)
    np.savez(path, x=x.reshape(5, 16), y=np.arange(5) % 3)  # flattened, integer labels
    with pytest.raises(InputError, match="'0', '1', '2' match none of the model's labels"):
        load_dataset(path, SPEC, LABELS)  # integers are names too, never silent indices
    assert list(load_dataset(path, SPEC, LABELS, label_map="indices").y) == [0, 1, 2, 0, 1]
    np.savez(path, x=np.zeros((3, 5, 5)), y=np.zeros(3, int))
    with pytest.raises(InputError, match=r"shape \(5, 5\)"):
        load_dataset(path, SPEC, LABELS)
    np.savez(path, x=np.zeros((3, 4, 4)), y=np.zeros(2, int))
    with pytest.raises(InputError, match="3 samples but y has 2"):
        load_dataset(path, SPEC, LABELS)
    path.write_bytes(b"PK\x03\x04 this is not a zip")
    with pytest.raises(InputError, match="not a readable NPZ"):
        load_dataset(path, SPEC, LABELS)
    np.savez(path, x=np.array([object()] * 2, dtype=object), y=np.zeros(2, int))
    with pytest.raises(InputError):  # pickled arrays are refused, not loaded
        load_dataset(path, SPEC, LABELS)


def test_empty_or_unknown_data_paths_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="empty"):
        detect_format(tmp_path)
    with pytest.raises(InputError, match="no such file"):
        detect_format(tmp_path / "missing")
    (tmp_path / "x.parquet").write_bytes(b"1")
    with pytest.raises(InputError, match="unknown data file type"):
        detect_format(tmp_path / "x.parquet")
    (tmp_path / "cat").mkdir()
    (tmp_path / "cat" / "a.png").write_bytes(b"garbage")
    with pytest.raises(InputError, match="no usable samples"):
        load_dataset(tmp_path, SPEC, LABELS)


def test_all_three_formats_give_the_same_samples(tmp_path: Path) -> None:
    rng = np.random.default_rng(2)
    images = rng.random((12, 1, 8, 8)).astype(np.float32)
    labels = rng.integers(0, 10, 12)
    spec = InputSpec(shape=(1, 8, 8), scale=1 / 255.0)
    names = [str(i) for i in range(10)]
    loaded = {fmt: load_dataset(write_data(tmp_path / fmt, images, labels, fmt), spec, names)
              for fmt in ("images", "csv", "npz")}
    keys = [dict(zip(d.hashes, d.y.tolist(), strict=True)) for d in loaded.values()]
    assert keys[0] == keys[1] == keys[2] and len(keys[0]) == len(set(map(sample_hash, images.round(3))))


def test_split_is_stable_as_the_data_grows() -> None:
    rng = np.random.default_rng(3)
    hashes = [sample_hash(rng.random((1, 2, 2))) for _ in range(600)]
    train, val = split_indices(hashes[:300], 0.2)
    train2, val2 = split_indices(hashes, 0.2)
    assert set(val) == {i for i in val2 if i < 300}  # old samples keep their side
    assert set(train) == {i for i in train2 if i < 300}
    assert 0.12 < len(val2) / 600 < 0.28
    _, tiny_val = split_indices(hashes[:2], 0.01)
    assert len(tiny_val) == 1  # always something to validate on


def test_split_dataset_records_counts(tmp_path: Path) -> None:
    path = tmp_path / "d.npz"
    np.savez(path, x=np.random.default_rng(4).integers(0, 256, (50, 16)), y=np.arange(50) % 3)
    data = load_dataset(path, SPEC, LABELS, label_map="indices")
    train, val = split_dataset(data, 0.3)
    assert len(train) + len(val) == 50 and data.report.train == len(train) and data.report.validation == len(val)
    assert not set(train.hashes) & set(val.hashes)

"""Misuse cases of the five commands (pretrain.py, finetune.py, python -m tpzoo.data, python -m
tpzoo.convert, python -m tpzoo.generate), run in ONE process: each command's ``main(argv)`` is called
in-process, in a fresh folder of its own, with file descriptors 1 and 2 captured.

    python tests/misuse_runner.py ROOT OUT.json [NAME ...]   # prepare inputs under ROOT, run, write results

The cases are ``misuse_cases.CASES``; their ``{placeholders}`` are the inputs ``prepare`` makes. A
result per case: exit code, stderr text, the uncaught exception's traceback (if any) and the watched
paths it changed.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import shlex
import shutil
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

from families import CAUSAL_LM, MASKED_LM
from misuse_cases import CASES, RANK_CASES, TINY

ROOT = Path(__file__).resolve().parents[1]
MODULES = {"pretrain": "pretrain", "finetune": "finetune", "data": "tpzoo.data.__main__",
           "convert": "tpzoo.convert.__main__", "generate": "tpzoo.generate"}


def _write(path: Path, text: str | bytes) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    (path.write_bytes if isinstance(text, bytes) else path.write_text)(text)
    return str(path)


def _jsonl(path: Path, rows: list[dict]) -> str:
    return _write(path, "".join(json.dumps(r) + "\n" for r in rows))


def _folder(path: Path, files: dict[str, str | bytes]) -> str:
    path.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        _write(path / name, text)
    return str(path)


def prepare(root: Path) -> dict[str, str]:
    """Every input the cases name, under ``root``: two tiny checkpoints (``causal_lm``, ``masked_lm``:
    pretrain.py's TINY flags, 2 steps), ``causal_lm`` as a Hugging Face folder (``hf``), both as tpzoo model folders
    (``tz``, ``tz_masked_lm``), the demo tokenizer, data and task, and bad files of every kind."""
    import datasets

    from tpzoo.data.demo import demo_data, demo_dir, demo_task
    from tpzoo.data.tokenizer import train_tokenizer

    tok, causal_data = demo_data("causal-lm")
    train, valid = demo_task()
    f = root / "inputs"
    rows = [json.loads(line) for line in Path(train).read_text().splitlines()[:6]]
    inputs = dict(tok=str(tok), data=str(causal_data), masked_lm_data=str(demo_data("masked-lm")[1]),
                  train=str(train), valid=str(valid), corpus=str(demo_dir() / "corpus.jsonl"),
                  cache=str(root / "cache"),
                  empty_dir=_folder(f / "empty_dir", {}), a_file=_write(f / "a_file", "not a folder\n"),
                  empty_jsonl=_write(f / "empty.jsonl", ""),
                  binary_jsonl=_write(f / "binary.jsonl", bytes(range(256)) * 8),
                  no_text_jsonl=_jsonl(f / "no_text.jsonl", [{"body": "the cat sat"}] * 3),
                  texts=_jsonl(f / "texts.jsonl", [{"text": "the cat sat on the mat"}] * 3),
                  instructions=_jsonl(f / "instructions.jsonl", [{"prompt": "the cat", "response": "sat"}] * 3),
                  corrupt_jsonl=_write(f / "corrupt.jsonl", '{"text": "a b"}\n{"text": "c d"}\n{"text": "e\n'),
                  corrupt_train=_write(f / "corrupt_train.jsonl",
                                       "".join(json.dumps(r) + "\n" for r in rows[:2]) + '{"text": "x", "lab\n'),
                  null_label_train=_jsonl(f / "null_label_train.jsonl", rows[:4] + [{"text": "odd", "label": None}]),
                  extra_label_valid=_jsonl(f / "extra_label_valid.jsonl", rows[:2] + [{"text": "odd", "label": 7}]),
                  no_label_train=_jsonl(f / "no_label_train.jsonl", [{"text": r["text"]} for r in rows]),
                  one_label_train=_jsonl(f / "one_label_train.jsonl", [{**r, "label": 1} for r in rows]),
                  ragged_csv=_write(f / "ragged.csv", "text,label\nthe cat,1\nthe dog,0,extra,fields\n"),
                  task_dir=_folder(f / "task_dir", {"train.jsonl": "".join(json.dumps(r) + "\n" for r in rows)}),
                  bad_latest=_folder(f / "bad_latest", {"latest": "iter_0000009\n"}),
                  mixed_labels_train=_jsonl(f / "mixed_labels_train.jsonl", [{"text": "good", "label": True},
                                            {"text": "bad", "label": False}, {"text": "fine", "label": 1}]),
                  numeric_text_train=_jsonl(f / "numeric_text_train.jsonl", [*rows[:2], {"text": 42, "label": 1}]),
                  null_text_train=_jsonl(f / "null_text_train.jsonl", [*rows[:2], {"text": None, "label": 1}]),
                  empty_texts_train=_jsonl(f / "empty_texts_train.jsonl", [{**r, "text": ""} for r in rows]),
                  missing_text_jsonl=_jsonl(f / "missing_text.jsonl", [{"text": "the cat sat"}, {"body": "a dog"}]),
                  array_lines_jsonl=_write(f / "array_lines.jsonl", "[1, 2]\n[3, 4]\n"),
                  file_iter_save=_folder(f / "file_iter_save", {"iter_0000040": "not a checkpoint\n"}),
                  latest_names_file=_folder(f / "latest_names_file", {"latest": "iter_0000040\n",
                                                                     "iter_0000040": "not a checkpoint\n"}),
                  other_tok=train_tokenizer(str(demo_dir() / "corpus.jsonl"), str(f / "other"), 120),
                  **_bad_indexed_datasets(f, str(causal_data)))
    inputs["saved_dict"] = str(f / "saved_dict")  # a DatasetDict folder of datasets' save_to_disk
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)}).save_to_disk(inputs["saved_dict"])
    for name, case in (("causal_lm", CAUSAL_LM), ("masked_lm", MASKED_LM)):
        _pretrain(root, case.family, name)
        inputs[name] = str(root / name)
    inputs.update(_damaged_records(f, Path(inputs["causal_lm"])))
    beside = f / "file_beside_checkpoints"  # a save dir whose latest names a file beside an intact checkpoint
    shutil.copytree(inputs["causal_lm"], beside)
    _write(beside / "iter_0000040", "not a checkpoint\n")
    inputs["file_beside_checkpoints"] = _write(beside / "latest", "iter_0000040\n") and str(beside)
    inputs["hf"] = str(root / "hf")
    assert _call("convert", ["to-hf", inputs["causal_lm"], inputs["hf"]]) == 0
    inputs["tz"] = str(root / "tz")  # a tpzoo model folder (with the demo tokenizer), as from-hf writes one
    assert _call("convert", ["from-hf", inputs["hf"], inputs["tz"]]) == 0
    masked_hf, inputs["tz_masked_lm"] = root / "masked_lm_hf", str(root / "tz_masked_lm")  # with its binary head
    assert _call("convert", ["to-hf", inputs["masked_lm"], str(masked_hf)]) == 0
    assert _call("convert", ["from-hf", str(masked_hf), inputs["tz_masked_lm"]]) == 0
    return {**inputs, **_bad_model_folders(f, Path(inputs["hf"]))}


def _damaged_records(f: Path, save: Path) -> dict[str, str]:
    """Copies of the checkpoint save folder ``save``: its metrics.jsonl with a garbage line before the last, its
    meta.json recording --train-iters "forty" (with the manifest rewritten, as a save would have written it)."""
    from tpzoo.checkpoint.manifest import write_manifest

    garbage, forty = f / "garbage_metrics", f / "forty_train_iters"
    for copy in (garbage, forty):
        shutil.copytree(save, copy)
    lines = (garbage / "metrics.jsonl").read_text().splitlines()
    (garbage / "metrics.jsonl").write_text("\n".join([lines[0], '{"iteration": "one"}', *lines[1:]]) + "\n")
    folder = forty / (forty / "latest").read_text().strip()
    meta = json.loads((folder / "meta.json").read_text())
    meta["args"]["train_iters"] = "forty"
    (folder / "meta.json").write_text(json.dumps(meta))
    (folder / "manifest.json").unlink()
    write_manifest(folder, {}, tuple(sorted(p.name for p in folder.iterdir())))
    return dict(garbage_metrics=str(garbage), forty_train_iters=str(forty))


def _bad_indexed_datasets(f: Path, prefix: str) -> dict[str, str]:
    """Copies of the indexed dataset ``prefix``: its .bin cut in half, its .idx garbage, its .idx cut short."""
    from tpzoo.data.indexed import paths

    bin_bytes, idx_bytes = (Path(p).read_bytes() for p in paths(prefix))
    out = {}
    for name, new_bin, new_idx in (("truncated", bin_bytes[: len(bin_bytes) // 2], idx_bytes),
                                   ("garbage_idx", bin_bytes, b"x" * len(idx_bytes)),
                                   ("short_idx", bin_bytes, idx_bytes[:40])):
        _folder(f / name, {"data.bin": new_bin, "data.idx": new_idx})
        out[name] = str(f / name / "data")
    return {**out, "truncated_dir": str(f / "truncated")}


def _bad_model_folders(f: Path, hf: Path) -> dict[str, str]:
    """Folders that look like Hugging Face or tpzoo model folders (``hf``: a good one) but cannot be converted:
    among them a config twice as wide as its weights, and sharded indexes naming files outside the folder."""
    t5 = json.dumps({"architectures": ["T5ForConditionalGeneration"], "model_type": "t5"})
    hf_config, weights = (hf / "config.json").read_text(), hf / "model.safetensors"
    wide = json.dumps({**json.loads(hf_config), "n_embd": 2 * json.loads(hf_config)["n_embd"]})
    index = {"absolute": str(weights.resolve()), "parent": f"../../{hf.name}/model.safetensors"}
    return dict(garbage_hf=_folder(f / "garbage_hf", {"config.json": "{not json"}),
                t5_hf=_folder(f / "t5_hf", {"config.json": t5}),
                garbage_tz=_folder(f / "garbage_tz", {"config.json": "{not json"}),
                no_weights_hf=_folder(f / "no_weights_hf", {"config.json": hf_config}),
                garbage_weights_hf=_folder(f / "garbage_weights_hf", {"config.json": hf_config,
                                                                      "model.safetensors": b"\x08" + bytes(64)}),
                wide_config_hf=_folder(f / "wide_config_hf", {"config.json": wide,
                                                              "model.safetensors": weights.read_bytes()}),
                **{f"{name}_index_hf": _folder(f / f"{name}_index_hf", {"config.json": hf_config,
                   "model.safetensors.index.json": json.dumps({"weight_map": {"lm_head.weight": shard}})})
                   for name, shard in index.items()})


def _pretrain(root: Path, model: str, save: str) -> None:
    flags = ["--model", model, "--save", str(root / save), "--eval-interval", "0"]
    code = _call("pretrain", shlex.split(TINY) + flags)
    assert code == 0, f"pretrain.py --model {model} failed"


def _entry(command: str) -> Callable[[list[str]], Any]:
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    return importlib.import_module(MODULES[command]).main


def _call(command: str, argv: list[str]) -> int:
    """``command``'s main(argv) here: its exit code (SystemExit's or the returned one)."""
    import torch.distributed as dist

    try:
        returned = _entry(command)(argv)
        code = returned if isinstance(returned, int) else 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return code


@contextlib.contextmanager
def _captured(out: Path):
    """File descriptors 1 and 2 (and sys.stdout / sys.stderr) into ``out``.stdout / ``out``.stderr."""
    sys.stdout.flush(), sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(f"{out}.stdout", "wb") as o, open(f"{out}.stderr", "wb") as e:
        os.dup2(o.fileno(), 1), os.dup2(e.fileno(), 2)
        try:
            yield
        finally:
            sys.stdout.flush(), sys.stderr.flush()
            os.dup2(saved[0], 1), os.dup2(saved[1], 2)
            os.close(saved[0]), os.close(saved[1])


def _files(folder: Path) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("*")}


def run_case(name: str, inputs: dict[str, str], root: Path) -> dict[str, Any]:
    """One case of ``CASES`` or ``RANK_CASES`` in its own folder ``root/cases/name``: exit code,
    stderr, traceback, the watched paths it changed (its folder, the file and folder it was given)."""
    command, argv, _ = {**CASES, **RANK_CASES}[name]
    folder = root / "cases" / name
    folder.mkdir(parents=True)
    watched = [Path(inputs[k]) for k in ("a_file", "empty_dir")] + [folder]
    before = {str(p): _files(p) if p.is_dir() else p.stat().st_size for p in watched}
    cwd, error, start = os.getcwd(), None, time.perf_counter()
    os.chdir(folder)
    try:
        with _captured(folder.with_suffix(".out")):
            code = _call(command, shlex.split(argv.format(**inputs)))
    except BaseException:  # an uncaught exception: what the test reports
        code, error = None, traceback.format_exc()
    finally:
        os.chdir(cwd)
    created = [p for p in before if (_files(Path(p)) if Path(p).is_dir() else Path(p).stat().st_size) != before[p]]
    return dict(code=code, stderr=Path(f"{folder}.out.stderr").read_text(errors="replace"), traceback=error,
                changed=created, seconds=round(time.perf_counter() - start, 3))


def run_on_rank(inputs: dict[str, str], root: str) -> dict[str, dict[str, Any]]:
    """Every ``RANK_CASES`` case on this rank (of a ``tpzoo.testing.spawn``), in ``root/rank<R>``;
    the ranks wait for each other between cases (a file per rank and case), so that no rank joins the
    next case's process group while another still holds the last one's."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    out = {}
    for name in RANK_CASES:
        out[name] = run_case(name, inputs, Path(root) / f"rank{rank}")
        done = [Path(root) / f"{name}.done{r}" for r in range(world)]
        done[rank].touch()
        while not all(p.exists() for p in done):
            time.sleep(0.05)
    return out


def main(argv: list[str]) -> None:
    root, out, names = Path(argv[0]), Path(argv[1]), argv[2:] or list(CASES)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    start = time.perf_counter()
    with _captured(root / "prepare"):
        inputs = prepare(root)
    print(f"inputs prepared in {time.perf_counter() - start:.1f} s")
    results = {name: run_case(name, inputs, root) for name in names}
    out.write_text(json.dumps({"inputs": inputs, "results": results}, indent=1))


if __name__ == "__main__":
    main(sys.argv[1:])

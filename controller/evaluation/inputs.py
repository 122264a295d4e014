"""What the requests of `load`, `sweep` and `bench` carry: random tensors from the model's config, or the user's data.

Every verb that sends traffic builds its requests from the model's live config (the JSON Triton serves): each
input's data type and dims, with a batch dimension in front where `max_batch_size` > 0. Random values: standard
normal for floats, 0-9 for integers (safe as token or class ids), "0"-"9" for strings. Two options fit that to a
model of the user's:

- `--shape NAME:D1,D2,...` sets the variable dims (-1 in the config) of an input. Without it a variable dim is
  sent as 1: harmless for a model of fixed dims, but a text model then sees one-token sequences and its service
  time is not the one it has in production, so the sweep, the bench and the controller learn the wrong curve.
- `--input-data FILE`: the requests' contents, in perf_analyzer's JSON format (one entry per request item, no
  batch dimension; the entries are sent in turn, request k carrying entry k mod N):

      {"data": [{"TOKENS": [101, 2023, 102], "MASK": {"content": [1, 1, 1], "shape": [3]}},
                {"TOKENS": [101, 7592, 2088, 102], "MASK": [1, 1, 1, 1]}]}

  A list of values is flat (row-major) and shaped by the config's dims: a variable dim from `--shape`, else the
  one the count implies (where one dim is variable); `{"content": [...], "shape": [...]}` gives the shape. Every
  input the config does not mark `optional` must be in every entry. perf_analyzer's `b64` content and sequence
  streams (a list of lists, for stateful models) are refused with a message: not built.

With `--batch-size B` a request stacks B entries in turn (k*B .. k*B+B-1 mod N), so those must have one shape.

Worked example: input TOKENS, TYPE_INT64, dims [-1], max_batch_size 8. No option: each request carries [1, 1]
int64. `--shape TOKENS:128`: [1, 128]. `--shape TOKENS:128 --batch-size 4`: [4, 128]. With the file above:
request 0 carries TOKENS [[101, 2023, 102]] and MASK [[1, 1, 1]], request 1 the four-token entry, request 2 the
first again; `--batch-size 2` with it is refused (shapes [3] and [4] cannot stack).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

__all__ = ["InputSpec", "InputSpecError", "parse_shape", "read_input_data", "input_sets", "variable_notes",
           "describe", "make_spec", "TRITON_TO_NUMPY"]

MAX_DATA_BYTES = 256 * 1024 * 1024     # an --input-data file larger than this is refused (it is held in memory)
MAX_SETS_BYTES = 1024 * 1024 * 1024    # the most the stacked requests of --batch-size may hold

TRITON_TO_NUMPY: dict[str, type] = {
    "TYPE_BOOL": np.bool_, "TYPE_UINT8": np.uint8, "TYPE_UINT16": np.uint16, "TYPE_UINT32": np.uint32,
    "TYPE_UINT64": np.uint64, "TYPE_INT8": np.int8, "TYPE_INT16": np.int16, "TYPE_INT32": np.int32,
    "TYPE_INT64": np.int64, "TYPE_FP16": np.float16, "TYPE_FP32": np.float32, "TYPE_FP64": np.float64,
    "TYPE_STRING": np.object_,
}


class InputSpecError(ValueError):
    """A --shape or --input-data the model's config cannot take: one line, naming the input."""


@dataclass(frozen=True)
class InputSpec:
    """The user's say on the inputs: `shapes` (input -> dims without the batch dim), `data` (the file's entries),
    `batch_size` (items a request carries, --batch-size)."""

    shapes: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    data: tuple[Mapping[str, Any], ...] | None = None
    source: str = "--input-data"          # names the file in messages
    batch_size: int = 1


def describe(spec: InputSpec | None) -> dict:
    """What a sweep.json (and load's --json) records of the requests' inputs, the bench comparing its own: {"random":
    true} plus any --shape dims, the data file and its entry count where one was given, and the items a request
    carries where more than one."""
    if spec is None:
        return {"random": True}
    doc: dict = {"random": spec.data is None}
    if spec.batch_size > 1:
        doc["batch_size"] = spec.batch_size
    if spec.shapes:
        doc["shapes"] = {name: list(dims) for name, dims in sorted(spec.shapes.items())}
    if spec.data is not None:
        doc.update(data=spec.source, entries=len(spec.data))
    return doc


def parse_shape(text: str) -> tuple[str, tuple[int, ...]]:
    """`NAME:D1,D2,...` -> (NAME, dims); every dim an integer >= 1. ValueError with a one-line reason."""
    name, sep, dims_text = text.rpartition(":")
    if not sep or not name or not dims_text:
        raise ValueError(f"expected NAME:D1,D2,... (e.g. TOKENS:128), got {text!r}")
    try:
        dims = tuple(int(d) for d in dims_text.split(","))
    except ValueError:
        raise ValueError(f"{text!r}: the dims must be integers, e.g. {name}:1,128") from None
    if any(d < 1 for d in dims):
        raise ValueError(f"{text!r}: every dim must be at least 1")
    return name, dims


def make_spec(shapes: Sequence[tuple[str, tuple[int, ...]]], input_data: Path | None,
              batch_size: int = 1) -> InputSpec | None:
    """The InputSpec of the --shape values, the --input-data file and --batch-size, or None where none was given."""
    by_name: dict[str, tuple[int, ...]] = {}
    for name, dims in shapes:
        if by_name.get(name, dims) != dims:
            raise InputSpecError(f"--shape {name}: given twice ({','.join(map(str, by_name[name]))} and "
                                 f"{','.join(map(str, dims))})")
        by_name[name] = dims
    data = None
    if input_data is not None:
        try:
            data = read_input_data(input_data)
        except InputSpecError as e:
            raise InputSpecError(f"--input-data: {e}") from None
    if not by_name and data is None and batch_size <= 1:
        return None
    return InputSpec(shapes=by_name, data=data, source=str(input_data or "--input-data"), batch_size=max(1, batch_size))


def read_input_data(path: Path) -> tuple[Mapping[str, Any], ...]:
    """The entries of a perf_analyzer-style JSON file (`{"data": [{input: values}, ...]}`), checked for form."""
    try:
        size = path.stat().st_size
        if size > MAX_DATA_BYTES:
            raise InputSpecError(f"{path}: {size / 2**20:.0f} MiB; at most {MAX_DATA_BYTES // 2**20} MiB is read")
        doc = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise InputSpecError(f"{path}: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise InputSpecError(f"{path}: not UTF-8 text ({e.reason})") from None
    except json.JSONDecodeError as e:
        raise InputSpecError(f"{path}: not JSON (line {e.lineno}, column {e.colno}: {e.msg})") from None
    entries = doc.get("data") if isinstance(doc, dict) else None
    if not isinstance(entries, list) or not entries:
        raise InputSpecError(f'{path}: expected {{"data": [{{"INPUT": [values], ...}}, ...]}} with at least one entry')
    for k, entry in enumerate(entries):
        if isinstance(entry, list):
            raise InputSpecError(f"{path}: data[{k}] is a list: sequence streams (stateful models) are not supported")
        if not isinstance(entry, dict) or not entry:
            raise InputSpecError(f"{path}: data[{k}]: expected an object of input name -> values")
        for name, value in entry.items():
            if isinstance(value, dict):
                if "b64" in value:
                    raise InputSpecError(f"{path}: data[{k}].{name}: b64 content is not supported; give the values")
                if not isinstance(value.get("content"), list):
                    raise InputSpecError(f'{path}: data[{k}].{name}: expected "content": [values] (and "shape")')
                shape = value.get("shape")
                if shape is not None and not (isinstance(shape, list) and all(
                        isinstance(d, int) and not isinstance(d, bool) and d >= 1 for d in shape)):
                    raise InputSpecError(f'{path}: data[{k}].{name}: "shape" must be a list of integers >= 1')
            elif not isinstance(value, list):
                raise InputSpecError(f"{path}: data[{k}].{name}: expected a list of values or "
                                     '{"content": [...], "shape": [...]}')
    return tuple(entries)


def _dims(spec: Mapping[str, Any]) -> tuple[int, ...]:
    return tuple(int(d) for d in spec.get("dims", []))


def _dtype(spec: Mapping[str, Any]) -> type:
    dtype = TRITON_TO_NUMPY.get(spec.get("data_type", ""))
    if dtype is None:
        raise InputSpecError(f"input {spec.get('name')!r}: data type {spec.get('data_type')} is not supported")
    return dtype


def _check_shape(name: str, config_dims: tuple[int, ...], dims: tuple[int, ...], where: str) -> None:
    if len(dims) != len(config_dims) or any(c != -1 and c != d for c, d in zip(config_dims, dims)):
        shown = "[" + ", ".join(str(c) for c in config_dims) + "]"
        free = " (-1: any)" if -1 in config_dims else ""
        raise InputSpecError(f"{where}: input {name!r} takes dims {shown}{free}; got "
                             f"[{', '.join(str(d) for d in dims)}]")


def _resolved_dims(name: str, config_dims: tuple[int, ...], spec: InputSpec) -> tuple[int, ...]:
    """The config's dims with --shape's (checked) or 1 for each variable dim."""
    given = spec.shapes.get(name)
    if given is not None:
        _check_shape(name, config_dims, given, "--shape")
        return given
    return tuple(max(1, d) for d in config_dims)


def _random(rng: np.random.Generator, shape: tuple[int, ...], dtype: type) -> np.ndarray:
    if dtype is np.object_:
        return np.array([str(v).encode() for v in rng.integers(0, 10, size=shape).ravel()],
                        dtype=np.object_).reshape(shape)
    if dtype is np.bool_:
        return rng.integers(0, 2, size=shape).astype(np.bool_)
    if np.issubdtype(dtype, np.integer):
        return rng.integers(0, 10, size=shape).astype(dtype)
    return rng.standard_normal(shape).astype(dtype)


def _entry_array(name: str, value: Any, config_dims: tuple[int, ...], dtype: type, spec: InputSpec,
                 where: str) -> np.ndarray:
    content, shape = (value["content"], value.get("shape")) if isinstance(value, dict) else (value, None)
    count = len(content)
    if shape is not None:
        dims = tuple(shape)
    elif name in spec.shapes:
        dims = spec.shapes[name]
    else:
        variable = [k for k, d in enumerate(config_dims) if d == -1]
        fixed = math.prod(d for d in config_dims if d != -1)
        if len(variable) > 1:
            raise InputSpecError(f"{where}: input {name!r} has {len(variable)} variable dims; give its shape "
                                 f'("shape": [...] beside "content", or --shape {name}:...)')
        if variable:
            if fixed == 0 or count % fixed or count == 0:
                raise InputSpecError(f"{where}: input {name!r}: {count} values do not fill dims "
                                     f"{list(config_dims)}")
            dims = tuple(count // fixed if d == -1 else d for d in config_dims)
        else:
            dims = config_dims
    _check_shape(name, config_dims, dims, where)
    if count != math.prod(dims):
        raise InputSpecError(f"{where}: input {name!r}: {count} values for shape {list(dims)} "
                             f"({math.prod(dims)} expected)")
    try:
        if dtype is np.object_:
            flat = np.array([v.encode() if isinstance(v, str) else str(v).encode() for v in content],
                            dtype=np.object_)
        else:
            if any(isinstance(v, (str, list, dict)) or v is None for v in content):
                raise ValueError("not a number")
            flat = np.array(content).astype(dtype, casting="unsafe")
            if np.issubdtype(dtype, np.integer) and not np.array_equal(flat, np.array(content)):
                raise ValueError(f"not integers that fit {np.dtype(dtype).name}")
    except (ValueError, TypeError, OverflowError) as e:
        raise InputSpecError(f"{where}: input {name!r}: values do not convert to {np.dtype(dtype).name} "
                             f"({e})") from None
    return flat.reshape(dims)


def _check_names(config: Mapping[str, Any], spec: InputSpec) -> None:
    names = [s["name"] for s in config.get("input", [])]
    for name in spec.shapes:
        if name not in names:
            raise InputSpecError(f"--shape {name}: the model has no input {name!r} (its inputs: {', '.join(names)})")
    for k, entry in enumerate(spec.data or ()):
        for name in entry:
            if name not in names:
                raise InputSpecError(f"{spec.source}: data[{k}].{name}: the model has no input {name!r} "
                                     f"(its inputs: {', '.join(names)})")


def input_sets(config: Mapping[str, Any], spec: InputSpec | None = None, *, seed: int = 0,
               batch_size: int = 1) -> list[dict[str, np.ndarray]]:
    """The tensors of each distinct request, sent in turn: one random set, or one per data entry.

    `batch_size` (items a request carries) is the spec's where this leaves it at 1.
    Raises InputSpecError (a one-line reason) where the spec does not fit the config.
    """
    spec = spec or InputSpec()
    batch_size = batch_size if batch_size != 1 else spec.batch_size
    inputs = list(config.get("input", []))
    if not inputs:
        raise InputSpecError(f"model config for {config.get('name', '?')!r} lists no inputs")
    _check_names(config, spec)
    max_batch = int(config.get("max_batch_size", 0) or 0)
    if batch_size > 1 and batch_size > max_batch:
        raise InputSpecError(f"--batch-size {batch_size}: model {config.get('name', '?')!r} takes "
                             + (f"at most {max_batch} per request" if max_batch else "no batch dimension"))
    batched = max_batch > 0
    if spec.data is None:
        rng = np.random.default_rng(seed)
        batch = (batch_size,) if batched else ()
        return [{s["name"]: _random(rng, batch + _resolved_dims(s["name"], _dims(s), spec), _dtype(s))
                 for s in inputs}]
    entries: list[dict[str, np.ndarray]] = []
    for k, entry in enumerate(spec.data):
        where = f"{spec.source}: data[{k}]"
        arrays = {}
        for s in inputs:
            name = s["name"]
            if name not in entry:
                if s.get("optional"):
                    continue
                raise InputSpecError(f"{where}: input {name!r} is missing (every entry needs each input the "
                                     "config does not mark optional)")
            arrays[name] = _entry_array(name, entry[name], _dims(s), _dtype(s), spec, where)
        entries.append(arrays)
    if not batched:
        return entries
    # why: the distinct requests repeat every N / gcd(N, B) (request k stacks entries kB .. kB+B-1 mod N), and each is
    # held ready to send, B entries' worth: cap what that holds
    n_sets = len(entries) // math.gcd(len(entries), batch_size)
    held = n_sets * batch_size * max(sum(a.nbytes for a in e.values()) for e in entries)
    if held > MAX_SETS_BYTES:
        raise InputSpecError(f"{spec.source}: {n_sets} distinct requests of {batch_size} entries would hold about "
                             f"{held / 2**20:.0f} MiB (at most {MAX_SETS_BYTES // 2**20} MiB): use fewer entries or a "
                             "smaller --batch-size")
    sets = []
    for k in range(n_sets):
        items = [entries[(k * batch_size + j) % len(entries)] for j in range(batch_size)]
        if any(item.keys() != items[0].keys() or any(item[n].shape != items[0][n].shape for n in item)
               for item in items[1:]):
            raise InputSpecError(f"{spec.source}: with --batch-size {batch_size} a request stacks entries in turn, "
                                 "so their inputs must have one shape each (and the same optional inputs)")
        sets.append({n: np.stack([item[n] for item in items]) for n in items[0]})
    return sets


def variable_notes(config: Mapping[str, Any], spec: InputSpec | None = None) -> list[str]:
    """One line per input whose variable dims go out as 1 (neither --shape nor --input-data set them)."""
    spec = spec or InputSpec()
    if spec.data is not None:
        return []
    notes = []
    for s in config.get("input", []):
        dims = _dims(s)
        if -1 in dims and s["name"] not in spec.shapes:
            sent = ",".join(str(max(1, d)) for d in dims)
            notes.append(f"input {s['name']} has variable dims {list(dims)}: sending [{sent}] "
                         f"(--shape {s['name']}:... sets them, --input-data FILE gives real requests)")
    return notes


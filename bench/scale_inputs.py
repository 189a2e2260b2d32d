#!/usr/bin/env python3
"""Writes the inputs of bench/scale.sh into a folder: large graphs and buffer lists.

    python3 bench/scale_inputs.py DIR

- matmul_pairs_N.json: N/2 independent pairs of matmuls (the first's output,
  a transient, read by the second); nothing fuses across pairs, so the
  planner, the fuser and the emitter each see N tasks.
- relu_pairs_N.json: the same with relus, which fuse into one kernel per pair.
- wide_object.json: a graph whose one task has 40,000 argument keys (an error
  to validate; the JSON reader's duplicate check is what it times).
- disjoint_1m.csv, random_1m.csv: 10^6 buffers in MiniMalloc's format, one
  after another in time, or at random in 2 x 10^6 steps.
- near_bound_1000.csv: 1,000 buffers on which greedy comes within 2% of the
  lower bound but not to it (what the search's near-bound cap is for).
Deterministic: the same folder every time.
"""
import json
import os
import random
import sys


def write(path, text):
    with open(path, "w") as f:
        f.write(text)


def pairs(op, n):
    def tensor(shape, external=False):
        t = {"dtype": "f32", "shape": shape}
        if external:
            t["storage"] = "external"
        return t

    tasks = []
    for i in range(n // 2):
        if op == "matmul":
            tasks.append({"id": f"a{i}", "op": "matmul", "phase": "forward",
                          "tensors": {"a": tensor([32, 32], True), "b": tensor([32, 32], True), "out": tensor([32, 32])}})
            tasks.append({"id": f"b{i}", "op": "matmul", "phase": "forward",
                          "tensors": {"a": {"from": f"a{i}.out"}, "b": tensor([32, 32], True),
                                      "out": tensor([32, 32], True)}})
        else:
            tasks.append({"id": f"a{i}", "op": "relu", "phase": "forward",
                          "tensors": {"x": tensor([64, 64], True), "out": tensor([64, 64])}})
            tasks.append({"id": f"b{i}", "op": "relu", "phase": "forward",
                          "tensors": {"x": {"from": f"a{i}.out"}, "out": tensor([64, 64], True)}})
    return json.dumps({"format": "cudagen.taskgraph/1", "name": f"{op}_pairs_{n}", "tasks": tasks})


def buffers(rows):
    return "id,lower,upper,size\n" + "".join(f"b{i},{lo},{hi},{size}\n" for i, (lo, hi, size) in enumerate(rows))


def main():
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    for n in (1000, 10000, 100000):
        write(os.path.join(out, f"matmul_pairs_{n}.json"), pairs("matmul", n))
    write(os.path.join(out, "relu_pairs_100000.json"), pairs("relu", 100000))
    args = {f"k{i}": i for i in range(40000)}
    write(os.path.join(out, "wide_object.json"), json.dumps({
        "format": "cudagen.taskgraph/1", "name": "wide", "tasks": [
            {"id": "r", "op": "relu", "tensors": {"x": {"dtype": "f32", "shape": [4], "storage": "external"},
                                                  "out": {"dtype": "f32", "shape": [4]}}, "args": args}]}))
    rng = random.Random(1)
    write(os.path.join(out, "disjoint_1m.csv"), buffers((i, i + 1, rng.randint(1, 1000) * 256) for i in range(10**6)))
    rows = []
    for _ in range(10**6):
        lo = rng.randint(0, 2 * 10**6)
        rows.append((lo, lo + rng.randint(1, 20), rng.randint(1, 1000) * 256))
    write(os.path.join(out, "random_1m.csv"), buffers(rows))
    rng = random.Random(1)
    rows = []
    for _ in range(1000):
        length = rng.choice([1, 2, 5, 20, 100, 250])
        lo = rng.randint(0, 500 - length)
        rows.append((lo, lo + length, rng.choice([1, 3, 7, 16, 33, 64, 100]) * 256))
    write(os.path.join(out, "near_bound_1000.csv"), buffers(rows))


if __name__ == "__main__":
    main()

"""benchmarks/merge_results.py: a partial run replaces its rows in place and says which run
measured each row (the committed results feed BENCHMARKS.md and the README's tables)."""

from benchmarks.merge_results import merge


def test_partial_run_replaces_rows_in_place_and_stamps_them():
    old = {"env": {"date": "old"}, "meta": {"runs": "first run"}, "rows": [
        {"part": "loss", "impl": "chunked", "ms": 28.8},
        {"part": "e2e", "shape": "a", "seq_len": 1, "tok_per_s": 10},
        {"part": "e2e", "shape": "a", "seq_len": 2, "tok_per_s": 20},
    ]}
    new = {"env": {"date": "T2"}, "meta": {}, "rows": [
        {"part": "e2e", "shape": "a", "seq_len": 2, "tok_per_s": 25},
        {"part": "e2e", "shape": "b", "seq_len": 1, "tok_per_s": 5},
    ]}
    merged = merge(old, new, ["part", "shape", "seq_len"], "partial")
    assert merged["rows"] == [
        {"part": "loss", "impl": "chunked", "ms": 28.8},  # no row of the new run matches it
        {"part": "e2e", "shape": "a", "seq_len": 1, "tok_per_s": 10},
        {"part": "e2e", "shape": "a", "seq_len": 2, "tok_per_s": 25, "run": "T2"},
        {"part": "e2e", "shape": "b", "seq_len": 1, "tok_per_s": 5, "run": "T2"},
    ]
    assert merged["meta"]["runs"] == "first run; T2: partial (2 rows)"
    assert merged["env"] == {"date": "T2"}
    assert old["rows"][2]["tok_per_s"] == 20  # the inputs are not modified

"""What a cache-key refusal names: the recorded parts that differ (format.key_change)."""

from __future__ import annotations

from featurestore.format.key_change import explain

SPLIT = {"encoder": {"spec": "builtin:tiny-vit", "weights_hash": "a" * 64, "precision": "fp32"},
         "preprocessing": {"resize": None, "mean": [0.5]}, "token_layout": {"grid": [4, 4]},
         "logical_dtype": "float16", "num_samples": 96, "source": {"fingerprint": {"size": 1}, "spec": "npy:x"}}


def test_only_the_parts_that_differ_are_named_each_once() -> None:
    run = {**SPLIT, "encoder": {**SPLIT["encoder"], "spec": "builtin:vit-s14", "weights_hash": "b" * 64},
           "source": {"fingerprint": {"size": 2}, "spec": "npy:y"}}
    text = explain(SPLIT, run)
    assert text.startswith("this run changes the encoder's weights (aaaaaaaaaaaa then, bbbbbbbbbbbb now); "
                           "the encoder (builtin:tiny-vit then, builtin:vit-s14 now); ")
    assert text.count("the input") == 1 and "size: 1 then, 2 now" in text  # the fingerprint, not also the spec
    assert "preprocessing" not in text and "dtype" not in text
    assert "seed it" not in text  # another encoder's weights differ by nature
    same_spec = {**SPLIT, "encoder": {**SPLIT["encoder"], "weights_hash": "b" * 64}}
    assert explain(SPLIT, same_spec).endswith("hashes differently on every run: seed it, or load fixed weights")


def test_a_lineage_names_its_changed_keys_and_a_bag_split_not_its_growing_count() -> None:
    old = {"kind": "bags", "num_samples": 500, "lineage": {"source": {"generation": "g1"}, "group_by": None}}
    new = {"kind": "bags", "num_samples": 0, "lineage": {"source": {"generation": "g2"}, "group_by": None}}
    text = explain(old, new)
    assert text == "this run changes the lineage (source.generation: g1 then, g2 now)"


def test_nothing_recorded_differs_gives_the_general_reasons() -> None:
    assert explain({"cache_key": "a"}, {"cache_key": "b"}) == (
        "this run has another encoder, weights, preprocessing, dtype or input")
    long = {**SPLIT, "preprocessing": {"mean": list(range(40))}}
    assert "..." in explain(SPLIT, long)  # a long value is cut, the line stays readable


def test_an_import_whose_labels_alone_changed_points_to_labels_at_probe_time() -> None:
    old = {"source": {"fingerprint": {"source": "f1", "labels": "a" * 64}}}
    new = {"source": {"fingerprint": {"source": "f1", "labels": "b" * 64}}}
    text = explain(old, new)
    assert text.startswith("this run changes the input (labels: aaaaaaaaaaaa then, bbbbbbbbbbbb now). Other labels")
    assert text.endswith("takes a task from a table at probe time")
    files_too = {"source": {"fingerprint": {"source": "f2", "labels": "b" * 64}}}
    assert "probe time" not in explain(old, files_too)  # other slide files: a new split indeed

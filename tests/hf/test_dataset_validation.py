"""--dataset_path is checked whole before any worker starts, through the one reader the worker
uses too (hf.data.snli_pairs): a bad line anywhere is one error line naming the file, the line
and what is wrong with it (exit 2), never a JSONDecodeError or AttributeError inside a worker."""

import json

import pytest

import profiling_script
from dp_cost.hf import data as hf_data
from dp_cost.hf import snli_file
from dp_cost.measure import plan, plan_checks

GOOD = json.dumps({"premise": "A man plays.", "hypothesis": "A man sleeps.", "label": 2})
BAD_LINE = 10_000

# (what line BAD_LINE holds, words the error says about it)
BAD_LINES = {
    "not_json": (b"premise: a cat", "not JSON (Expecting value: column 1)"),
    "truncated": (GOOD[:20].encode(), "not JSON (Unterminated string starting at: column 13)"),
    "a_list": (b'["a", "b", 0]', "not a JSON object (a list)"),
    "a_string": (b'"premise"', "not a JSON object (a string)"),
    "no_premise": (b'{"hypothesis": "b", "label": 0}', "no premise (or sentence1) field"),
    "no_hypothesis": (b'{"sentence1": "a", "gold_label": "neutral"}', "no hypothesis (or"),
    "no_label": (b'{"premise": "a", "hypothesis": "b"}', "no label (or gold_label) field"),
    "premise_number": (b'{"premise": 3, "hypothesis": "b", "label": 0}', "premise is a number"),
    "hypothesis_null": (b'{"premise": "a", "hypothesis": null, "label": 0}', "hypothesis is null"),
    "label_unknown": (b'{"premise": "a", "hypothesis": "b", "label": "maybe"}', 'label is "maybe"'),
    "label_bool": (b'{"premise": "a", "hypothesis": "b", "label": true}', "label is true"),
    "label_float": (b'{"premise": "a", "hypothesis": "b", "label": 1.5}', "label is 1.5"),
    "label_list": (b'{"premise": "a", "hypothesis": "b", "gold_label": [0]}', "gold_label is [0]"),
    "not_utf8": (b'{"premise": "\xff\xfe", "hypothesis": "b", "label": 0}', "not UTF-8 (byte 14"),
    "nested": (b"[" * 100_000 + b"]" * 100_000, "JSON nested too deep"),
    "long_line": (b"x" * (2**20 + 1), "longer than the cap of 1 MiB"),
}


def dataset_with_a_bad_line(tmp_path, bad: bytes):
    path = tmp_path / "snli.jsonl"
    path.write_bytes((GOOD + "\n").encode() * (BAD_LINE - 1) + bad + b"\n" + GOOD.encode())
    return path


@pytest.mark.parametrize("kind", BAD_LINES)
def test_a_bad_line_far_down_is_one_error_naming_the_file_and_the_line(tmp_path, capsys, kind):
    bad, words = BAD_LINES[kind]
    path = dataset_with_a_bad_line(tmp_path, bad)
    out = tmp_path / "out"
    argv = ["--model", "tiny-llama", "--dataset_path", str(path), "--output_dir", str(out)]
    assert profiling_script.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: --dataset_path {path} "), err
    assert f"line {BAD_LINE}: " in err and words in err, err
    assert "Traceback" not in err and not out.exists()


@pytest.mark.parametrize("kind", ["not_json", "a_list", "no_label", "label_bool"])
def test_the_worker_reads_through_the_same_checks(tmp_path, kind):
    """A file changed after the plan checked it fails in the worker with the same words."""
    path = dataset_with_a_bad_line(tmp_path, BAD_LINES[kind][0])
    with pytest.raises(snli_file.DatasetError) as raised:
        hf_data.load_snli(path, seq_len=16, vocab_size=64)
    with pytest.raises(plan.UsageError) as refused:
        plan_checks.check_dataset_file(str(path), 1)
    assert str(refused.value) == f"--dataset_path {raised.value}"
    assert f"line {BAD_LINE}: {BAD_LINES[kind][1]}" in str(raised.value)


def test_rows_without_a_gold_label_are_not_counted_as_pairs(tmp_path, capsys):
    """SNLI's own file: sentence1/sentence2/gold_label, "-" where annotators disagreed, a byte
    order mark, CRLF line ends, blank lines. N (B/N) is the labelled pairs the worker keeps."""
    rows = [
        {"sentence1": "a", "sentence2": "b", "gold_label": "entailment"},
        {"sentence1": "c", "sentence2": "d", "gold_label": "-"},
        {"premise": "e", "hypothesis": "f", "label": -1},
        {"premise": "g", "hypothesis": "h", "label": 1},
        {"premise": "i", "hypothesis": "j", "label": 0, "extra": [1, 2]},
    ]
    path = tmp_path / "snli.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + b"\r\n\r\n".join(json.dumps(r).encode() for r in rows))
    assert plan_checks.check_dataset_file(str(path), 3) == 3
    assert [label for _, _, label in snli_file.snli_pairs(path)] == [0, 1, 0]
    _, labels = hf_data.load_snli(path, seq_len=8, vocab_size=64)
    assert labels.tolist() == [0, 1, 0]
    with pytest.raises(plan.UsageError, match="has 3 labelled pairs, fewer than the batch size 4"):
        plan_checks.check_dataset_file(str(path), 4)
    unlabelled = tmp_path / "unlabelled.jsonl"
    unlabelled.write_text(json.dumps(rows[1]) + "\n")
    with pytest.raises(plan.UsageError, match="no labelled premise/hypothesis pairs"):
        plan_checks.check_dataset_file(str(unlabelled), 1)

"""How counts read in messages."""

from ortflow.wording import plural


def test_plural_adds_s_or_es_unless_the_count_is_one():
    assert [plural(1, "rank"), plural(2, "rank"), plural(0, "stage")] == ["1 rank", "2 ranks", "0 stages"]
    assert [plural(1, "micro-batch"), plural(8, "micro-batch"), plural(3, "pass")] == [
        "1 micro-batch", "8 micro-batches", "3 passes"]

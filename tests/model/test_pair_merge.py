"""The pair-merging loop of both tokenizers: the smallest priority merges first, leftmost on ties,
pairs without a priority never merge, and merged pieces merge again with their neighbours."""

from __future__ import annotations

from prima.model.pair_merge import merge_pairs


def ranks(*merges: str) -> dict[tuple[str, str], int]:
    """BPE-style merge ranks from 'left right' lines, first line best."""
    out = {}
    for rank, line in enumerate(merges):
        left, right = line.split(" ")
        out[left, right] = rank
    return out


def test_the_best_pair_merges_first_and_merged_pieces_merge_again() -> None:
    table = ranks("l o", "lo w", "e r")
    assert merge_pairs("lower", lambda a, b: table.get((a, b))) == ["low", "er"]


def test_ties_merge_leftmost_first() -> None:
    # "aaa": both pairs tie; merging the left one leaves ["aa", "a"].
    assert merge_pairs("aaa", lambda a, b: 0 if (a, b) == ("a", "a") else None) == ["aa", "a"]


def test_rank_order_not_position_decides() -> None:
    table = ranks("b c", "a b")
    assert merge_pairs("abc", lambda a, b: table.get((a, b))) == ["a", "bc"]


def test_pairs_without_a_priority_stay_apart() -> None:
    assert merge_pairs("abc", lambda a, b: None) == ["a", "b", "c"]


def test_scores_work_as_negated_priorities() -> None:
    # SentencePiece merges the highest score: the caller negates it.
    def by_score(scores: dict[str, float]) -> list[str]:
        return merge_pairs("abc", lambda a, b: -scores[a + b] if a + b in scores else None)

    assert by_score({"ab": 1.0, "bc": 5.0}) == ["a", "bc"]
    assert by_score({"ab": 1.0, "bc": 5.0, "abc": 0.5}) == ["abc"]


def test_empty_and_single_character_text() -> None:
    assert merge_pairs("", lambda a, b: 0) == []
    assert merge_pairs("x", lambda a, b: 0) == ["x"]

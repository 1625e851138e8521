"""Which held cache a request continues (prima.engine.prefix): the one it extends, else a new
one while there is room, else the longest shared prefix, else the least recently used."""

from __future__ import annotations

from prima.engine.prefix import choose_held, common_prefix


def test_common_prefix_counts_the_leading_ids_shared() -> None:
    assert common_prefix([1, 2, 3], [1, 2, 4, 5]) == 2
    assert common_prefix([1, 2], [1, 2, 3]) == 2
    assert common_prefix([], [1]) == 0
    assert common_prefix([2], [1]) == 0


def test_a_cache_the_prompt_extends_wins_the_longest_first() -> None:
    held = [[1, 2], [1, 2, 3], [9]]
    assert choose_held(held, [1, 2, 3, 4], can_grow=True) == 1
    assert choose_held(held, [1, 2, 7], can_grow=False) == 0
    assert choose_held([[], [5]], [1], can_grow=True) == 0  # an empty cache loses nothing


def test_a_prompt_that_would_cut_a_cache_gets_a_new_one_while_there_is_room() -> None:
    held = [[1, 2, 3], [7, 8]]
    assert choose_held(held, [1, 2, 4], can_grow=True) is None
    assert choose_held([], [1], can_grow=False) is None


def test_once_full_the_longest_shared_prefix_else_the_least_recently_used() -> None:
    held = [[7, 8], [1, 2, 3], [1, 5]]
    assert choose_held(held, [1, 2, 4], can_grow=False) == 1
    assert choose_held(held, [4, 4], can_grow=False) == 0

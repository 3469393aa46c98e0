"""Shared-prefix scoring equals full recomputation to the bit (the CPU's batch-invariant kernels) in every shape a
request can take."""

from __future__ import annotations

import numpy as np
import pytest

from tests.runtime.conftest import scorer_for, small_plan

pytestmark = pytest.mark.slow

QUERY = ("You are a careful assistant. Read the review and answer with one word. Review: the food was cold, "
         "the waiter forgot us twice and the bill was wrong. Is the review positive or negative? Answer:")
LABELS = [7042, 2731, 3524, 0, 49151]


@pytest.fixture(scope="module")
def scorers(embedded_shaped_dir):
    def plan(sharing):
        return small_plan(lengths=(64, 128), batches=(1, 8), prefix_sharing=sharing, suffix_lengths=(8, 32),
                          suffix_batches=(4, 8))
    return scorer_for(embedded_shaped_dir, plan=plan(True)), scorer_for(embedded_shaped_dir, plan=plan(False))


def assert_shared_equals_full(scorers, sequences, expect_shared=True):
    shared, full = scorers
    batches_before = shared.prefix_batches
    got = shared.score(sequences, LABELS)
    assert (shared.prefix_batches > batches_before) == expect_shared
    assert np.array_equal(got, full.score(sequences, LABELS))


def test_text_mode_items_of_very_different_lengths(scorers, tokenizer):
    items = [" positive", " negative", "", " I think it is clearly a negative review, because everything failed"]
    assert_shared_equals_full(scorers, [tokenizer.encode(QUERY + item) for item in items])


def test_item_first_shares_nothing_unless_items_agree(scorers, tokenizer):
    items = ["Great food!", "Great service, bad food."]  # common prefix "Great" only
    assert_shared_equals_full(scorers, [tokenizer.encode(item + QUERY) for item in items], expect_shared=False)
    opening = ("Here is a review a customer left on our website last week, after a long dinner with three friends at "
               "the restaurant on the corner. The owner asked us to read it. Review one says: ")  # over 32 tokens
    shared_start = [opening + x for x in ("great", "awful", "fine, I guess")]
    assert_shared_equals_full(scorers, [tokenizer.encode(item + QUERY[:60]) for item in shared_start])


def test_token_mode_and_an_empty_item(scorers, tokenizer):
    query = tokenizer.encode(QUERY)
    assert_shared_equals_full(scorers, [query + [], query + [330], query + [389, 340, 13]])


def test_one_item_is_scored_in_full(scorers, tokenizer):
    assert_shared_equals_full(scorers, [tokenizer.encode(QUERY)], expect_shared=False)


def test_item_that_changes_the_tokenization_at_the_query_boundary(scorers, tokenizer):
    query = QUERY + " pos"
    sequences = [tokenizer.encode(query + item) for item in ("itive", "", "t office", "sible")]
    # "pos" + "itive" merges into other tokens than "pos" alone: the common prefix is shorter than the query.
    assert sequences[0][: len(tokenizer.encode(query))] != tokenizer.encode(query)
    assert_shared_equals_full(scorers, sequences)


def test_many_items_run_several_batches_against_one_prefix(scorers, tokenizer):
    items = [f" option {i}: {'very ' * (i % 5)}good" for i in range(19)]
    assert_shared_equals_full(scorers, [tokenizer.encode(QUERY + item) for item in items])

"""Speculative decoding: propose a few tokens cheaply, verify them in one forward of the target model.

- config.py: ``SpeculativeConfig``, the user's ``speculative_config`` validated once.
- ngram_proposer.py: prompt lookup, the continuation of the latest earlier match of the context's tail.
- draft_proposer.py: a smaller model with the same vocabulary, run over the target's paged KV layout.
- rejection_sampler.py: which proposals the target accepts, so that output is exactly the target's.

The scheduler sees proposals only as more tokens to compute (``Request.spec_token_ids``); see
docs/speculative.md for the whole path and the rule that turns speculation off for large batches.
"""

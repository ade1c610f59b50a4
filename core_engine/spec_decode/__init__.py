"""Speculative decoding: propose tokens cheaply, verify them in the target's own forward.

* :mod:`.ngram` — prompt lookup, vectorised over the batch;
* :mod:`.draft` — a draft model with its own paged KV;
* :mod:`.rejection` — verification that keeps greedy output and the sampled distribution
  exactly the target's;
* :mod:`.speculator` — per request and step, asks the speculation policy and runs the proposers.

The scheduler (:mod:`core_engine.scheduler`) fits proposals into the step as multi-token
decodes with lookahead KV slots; the model runner scores them in the same batched forward as
the other requests; rejected proposals' slots are given back the same step.
"""

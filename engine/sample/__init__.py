"""Sampling: the sampler (greedy/temperature/top-k/top-p/penalties), structured output grammars and their compiler process, prompt logprobs."""

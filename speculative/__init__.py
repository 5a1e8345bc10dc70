"""HistoSpec: speculative decoding whose drafts come from each prompt's previous responses.

Pure drafter logic (history store, suffix matching, adaptive draft length) plus the vLLM proposer that
plugs it into vLLM's rejection sampler, so sampling stays exactly the policy's.
"""

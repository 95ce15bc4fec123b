"""Verification: small pure functions from target outputs and drafts to accepted tokens.

Each has a Triton kernel and a plain-torch reference of the same signature in kernels/; the
kernel runs on GPU tensors. Greedy verification is lossless by construction: every emitted
token is the target's argmax given the tokens before it.
"""
from __future__ import annotations

from kernels.greedy_verify import greedy_verify  # noqa: F401  (drafts [B,k], logits [B,k+1,V] → accepted, bonus)

NO_DRAFT = -1  # fills draft slots a proposer left empty; never equals a target token

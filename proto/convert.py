"""Conversions between the proto messages and the domain objects on either side."""

from __future__ import annotations

from radixmesh.core.sampling_params import SamplingParams
from radixmesh.proto import worker_pb2 as pb


def sampling_to_proto(p: SamplingParams, seed: int) -> pb.SamplingParams:
    """What the worker needs of a request's sampling parameters (stop strings stay behind)."""
    return pb.SamplingParams(
        temperature=p.temperature,
        top_p=p.top_p,
        top_k=p.top_k,
        min_p=p.min_p,
        frequency_penalty=p.frequency_penalty,
        presence_penalty=p.presence_penalty,
        repetition_penalty=p.repetition_penalty,
        min_new_tokens=p.min_new_tokens,
        stop_token_ids=p.stop_token_ids,
        seed=seed,
        ignore_eos=p.ignore_eos,
    )


def sampling_from_proto(p: pb.SamplingParams) -> SamplingParams:
    """The worker's side of sampling_to_proto."""
    return engine_params_from_proto(p, max(p.min_new_tokens, 1))


def engine_params_from_proto(p: pb.SamplingParams, max_new_tokens: int) -> SamplingParams:
    """The scheduler's view of a request's sampling parameters from the mesh message."""
    return SamplingParams(
        max_new_tokens=max_new_tokens,
        min_new_tokens=p.min_new_tokens,
        temperature=p.temperature,
        top_p=p.top_p,
        top_k=p.top_k,
        min_p=p.min_p,
        frequency_penalty=p.frequency_penalty,
        presence_penalty=p.presence_penalty,
        repetition_penalty=p.repetition_penalty,
        stop_token_ids=list(p.stop_token_ids),
        ignore_eos=p.ignore_eos,
        seed=p.seed,
    )

"""Batch jobs: an OpenAI Batch API request file run through the server's continuous batching, resumably.

`run_batch(engine, tokenizer, requests)` runs requests in this process and returns a BatchReport; `run_job` is the
whole `moestream batch` job (input index, crash-safe output, resume); distributed.py spreads a job over Ray.
"""
from moestream.batch.inputs import BatchRequest, InputError, index_input, requests_from
from moestream.batch.job import JobConfig, run_job
from moestream.batch.output import OutputError
from moestream.batch.report import BatchReport
from moestream.batch.runner import BatchOptions, run_batch

__all__ = ["BatchOptions", "BatchReport", "BatchRequest", "InputError", "JobConfig", "OutputError", "index_input",
           "requests_from", "run_batch", "run_job"]

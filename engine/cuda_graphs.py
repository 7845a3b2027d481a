"""CUDA graphs for decode steps: capture the model forward once per batch size, replay it every step.

A decode step of a small model is dominated by the CPU cost of launching a few hundred kernels; a CUDA
graph replays them all with one launch. Graphs freeze tensor addresses and shapes, so every captured
forward reads its inputs from static buffers (sized for the largest batch) and a step is padded up to
the nearest captured batch size:

- padding rows are one-token sequences with seq_len 0 and slot -1: they store no K/V, attend to no
  key (the kernel outputs zeros for them) and their hidden states are dropped;
- query_start_loc of a decode batch is always 0, 1, 2, ...: a constant buffer;
- the attention launch is planned at capture for max_model_len-long contexts (the split-KV count is
  chosen then); each split covers its share of the actual context length at replay, so shorter
  contexts stay correct.

Only the triton backend can be captured: it never reads device values back to the host (the torch
backend builds index tensors from host lists every step).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from kvpilot.engine.attention import AttentionBackend, AttentionMetadata

# Forward of the whole model over a flat batch: (input_ids, positions, metadata) -> hidden [num_tokens, hidden].
ForwardFn = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8 up to max_num_seqs (and max_num_seqs itself)."""
    sizes = [size for size in (1, 2, 4) if size < max_num_seqs]
    sizes += list(range(8, max_num_seqs, 8))
    return sorted({*sizes, max_num_seqs})


class DecodeCudaGraphs:
    """Replays decode-only batches of up to max(sizes) sequences through captured graphs.

    With use_graphs=False the same padded static batch runs eagerly instead of being replayed, which is
    what a graph would have recorded: the tests use that to check the padding and staging on CPU.
    """

    def __init__(self, forward: ForwardFn, *, sizes: Sequence[int], max_model_len: int, block_size: int,
                 device: torch.device, use_graphs: bool = True) -> None:
        if not sizes or min(sizes) < 1:
            raise ValueError(f"sizes must be positive batch sizes, got {list(sizes)}")
        if use_graphs and device.type != "cuda":
            raise ValueError(f"CUDA graphs need a cuda device, got {device}; use enforce_eager on {device.type}")
        self._forward = forward
        self.sizes = sorted(set(sizes))
        self.max_model_len = max_model_len
        self.use_graphs = use_graphs
        max_batch = self.sizes[-1]
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        kw = {"device": device}
        # Static inputs, sliced per captured size; a replay copies the step's values into them.
        self._input_ids = torch.zeros(max_batch, dtype=torch.int64, **kw)  # [max_batch]
        self._positions = torch.zeros(max_batch, dtype=torch.int64, **kw)  # [max_batch]
        self._query_start_loc = torch.arange(max_batch + 1, dtype=torch.int32, **kw)  # [max_batch + 1], constant
        self._seq_lens = torch.zeros(max_batch, dtype=torch.int32, **kw)  # [max_batch]
        self._block_tables = torch.zeros(max_batch, self.max_blocks_per_seq, dtype=torch.int32, **kw)
        self._slot_mapping = torch.full((max_batch,), -1, dtype=torch.int64, **kw)  # [max_batch]
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, torch.Tensor] = {}  # size -> hidden [size, hidden_size] written by its graph

    @classmethod
    def for_model(cls, model: torch.nn.Module, kv_caches: list[torch.Tensor], backend: AttentionBackend, *,
                  max_num_seqs: int, max_model_len: int, block_size: int, device: torch.device,
                  use_graphs: bool = True) -> "DecodeCudaGraphs":
        """Capture (or, without graphs, prepare) decode batches for a CausalLM and its KV caches."""
        if backend.name != "triton":
            raise ValueError(f"CUDA graphs need the triton attention backend, not {backend.name!r}; "
                             "set attention_backend=triton or enforce_eager=True")

        def forward(input_ids, positions, metadata):
            return model(input_ids, positions, kv_caches, metadata, backend)

        graphs = cls(forward, sizes=capture_sizes(max_num_seqs), max_model_len=max_model_len,
                     block_size=block_size, device=device, use_graphs=use_graphs)
        if use_graphs:
            graphs.capture()
        return graphs

    def _metadata(self, size: int) -> AttentionMetadata:
        return AttentionMetadata(
            query_start_loc=self._query_start_loc[: size + 1],
            seq_lens=self._seq_lens[:size],
            block_tables=self._block_tables[:size],
            slot_mapping=self._slot_mapping[:size],
            max_query_len=1,
            # Plan for the longest context any step may bring.
            max_seq_len=self.max_model_len,
            query_start_loc_cpu=list(range(size + 1)),
            seq_lens_cpu=[self.max_model_len] * size,
        )

    def _run_static(self, size: int) -> torch.Tensor:
        return self._forward(self._input_ids[:size], self._positions[:size], self._metadata(size))

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size, largest first, sharing one memory pool (the padding rows store nothing)."""
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            # Compile every kernel variant before capture: a graph must not record a JIT compile.
            for size in self.sizes:
                self._run_static(size)
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        for size in reversed(self.sizes):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._outputs[size] = self._run_static(size)
            self._graphs[size] = graph
        torch.cuda.synchronize()

    def padded_size(self, num_seqs: int) -> int | None:
        """The smallest captured size that fits num_seqs, or None when the batch is too large."""
        for size in self.sizes:
            if size >= num_seqs:
                return size
        return None

    def can_run(self, metadata: AttentionMetadata) -> bool:
        """True for a decode-only batch (one token per sequence) that fits a captured size."""
        num_seqs = metadata.num_seqs
        return (metadata.max_query_len == 1 and metadata.query_start_loc_cpu[-1] == num_seqs
                and self.padded_size(num_seqs) is not None
                and metadata.block_tables.shape[1] <= self.max_blocks_per_seq
                and metadata.max_seq_len <= self.max_model_len)

    @torch.inference_mode()
    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        """Hidden states [num_seqs, hidden_size] of a decode batch that can_run accepted."""
        num_seqs = metadata.num_seqs
        size = self.padded_size(num_seqs)
        assert size is not None and self.can_run(metadata)
        width = metadata.block_tables.shape[1]
        self._input_ids[:num_seqs].copy_(input_ids)
        self._positions[:num_seqs].copy_(positions)
        self._seq_lens[:num_seqs].copy_(metadata.seq_lens)
        self._block_tables[:num_seqs, :width].copy_(metadata.block_tables)
        self._slot_mapping[:num_seqs].copy_(metadata.slot_mapping)
        # Padding rows: one token each, no context, nothing stored.
        self._input_ids[num_seqs:size].zero_()
        self._positions[num_seqs:size].zero_()
        self._seq_lens[num_seqs:size].zero_()
        self._slot_mapping[num_seqs:size].fill_(-1)
        if self.use_graphs:
            self._graphs[size].replay()
            hidden = self._outputs[size]
        else:
            hidden = self._run_static(size)
        return hidden[:num_seqs]

"""Which rows of a step attend together (kernels/query_blocks.py): what the megakernel's query blocks read."""

from kernels.query_blocks import query_blocks, uses_blocks


def test_a_prompt_chunk_is_cut_into_even_blocks_and_decode_rows_stand_alone() -> None:
    # two decode rows, a prompt's 6 rows at 30..35, a fresh prompt's 2 rows, two padding rows (the scratch slot at 0)
    slots = [0, 1, 2, 2, 2, 2, 2, 2, 3, 3, 9, 9]
    positions = [5, 7, 30, 31, 32, 33, 34, 35, 0, 1, 0, 0]
    first, rows, last, index, tail = query_blocks(slots, positions, 4)
    assert first == [0, 1, 2, 2, 2, 5, 5, 5, 8, 8, 10, 11]  # 6 rows: 3 + 3, not 4 + 2
    assert rows == [1, 1, 3, 3, 3, 3, 3, 3, 2, 2, 1, 1]
    assert last == [5, 7, 32, 32, 32, 35, 35, 35, 1, 1, 0, 0]
    assert index == [0, 0, 0, 1, 2, 0, 1, 2, 0, 1, 0, 0]
    assert tail == [0, 1, 4, 4, 4, 7, 7, 7, 9, 9, 10, 11]


def test_a_chunk_s_sampled_last_row_put_first_ends_its_run() -> None:
    # as the engine orders a step: the rows that sample first (a decode row; each prompt's last row), then the
    # prompts' other rows; slot 4's 9 tokens make blocks of 3, its last row (row 1) the last block's tail
    slots = [7, 4, 5, *[4] * 8, 5, 5]
    positions = [40, 8, 12, *range(8), 10, 11]
    first, rows, last, index, tail = query_blocks(slots, positions, 4)
    assert first[3:11] == [3, 3, 3, 6, 6, 6, 9, 9] and first[1] == 9
    assert rows[1] == 3 and last[1] == 8 and index[1] == 2 and tail[9] == 1 and tail[3] == 5
    assert (first[2], rows[2], index[2], tail[11]) == (11, 3, 2, 2)  # slot 5: rows 11, 12 and its first row
    assert (rows[0], first[0], tail[0]) == (1, 0, 0)


def test_the_blocks_launch_is_taken_only_by_steps_of_blocks_over_long_contexts() -> None:
    # a voice turn: 40 new tokens over a 2,000-token conversation, its last row first, in the 64-row bucket
    slots = [0] * 40 + [9] * 24
    positions = [2039, *range(2000, 2039), *[0] * 24]
    blocks = query_blocks(slots, positions, 4)
    assert uses_blocks(blocks, 40, 1 << 15)
    # the same turn at the start of a conversation; and beside a decode row
    assert not uses_blocks(query_blocks([0] * 40, [39, *range(39)], 4), 40, 1 << 15)
    assert not uses_blocks(query_blocks([1, *slots[:40]], [3000, *positions[:40]], 4), 41, 1 << 15)


def test_a_bound_of_zero_takes_the_launch_for_any_block_beside_decode_rows() -> None:
    blocks = query_blocks([1, 0, 0, 0], [3000, 5, 6, 7], 4)
    assert uses_blocks(blocks, 4, 0) and not uses_blocks(blocks, 4, 1)
    assert not uses_blocks(query_blocks([0, 1], [5, 5], 4), 2, 0)


def test_the_megakernel_decoder_works_out_blocks_only_for_steps_that_may_take_their_launch(monkeypatch) -> None:
    """The decoder's host path: a short prompt alone (a fresh request's first token) and decode rows of several slots
    skip the blocks' host work (8-36 us at 16-64 rows); a voice turn's prompt over a long conversation takes the
    launch, and counts (parley_query_block_steps_total)."""
    import torch

    from kernels.megakernel import KernelConfig
    from service.backends import megakernel as backend
    from service.model.synthetic import load_synthetic

    config, w, _ = load_synthetic("tiny", dtype=torch.float32)
    dec = backend.MegakernelDecoder(config, w, max_slots=2, max_context=1024, device="cpu", dtype=torch.float32,
                                    max_batch=4, max_rows=32, use_cuda_graphs=False,
                                    kernel_config=KernelConfig(query_blocks=True, block_min_positions=4096))
    worked_out, launches = [], []
    monkeypatch.setattr(backend, "query_blocks", lambda *a: worked_out.append(a[0]) or query_blocks(*a))
    monkeypatch.setattr(dec.kernel, "step", lambda bucket, blocks=False, one_lm=False: launches.append(blocks))

    def step(slots: list[int], positions: list[int]) -> None:
        dec.decode(slots, [1] * len(slots), positions, sampled_rows=1)

    step([0] * 16, [15, *range(15)])  # a 16-token prompt alone: 256 positions at most
    step([0, 1, 0, 1], [900, 900, 901, 901])  # decode rows of two slots, long contexts
    assert worked_out == [] and launches == [False, False] and dec.query_block_steps == 0
    step([0] * 16, [1015, *range(1000, 1015)])  # a voice turn's 16 new tokens over 1,000 cached ones
    assert len(worked_out) == 1 and launches[-1] is True and dec.query_block_steps == 1

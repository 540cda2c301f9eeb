"""Pages (beamplugin.runtime.pages): a mapped weight's pages handed back without losing what the
process wrote, buffers of zeros that take memory only where written, pages given back as zeros,
and a self-attention history that gives its outgrown buffer back as it moves out of it."""

import mmap
import struct

import torch

from beamplugin.modules.attention import attention_memory_pool
from beamplugin.modules.self_attention_history import SelfAttentionHistory
from beamplugin.runtime import pages
from beamplugin.runtime.pages import FileMappings, page_out


def resident_pages(tensor: torch.Tensor) -> int:
    """How many whole pages inside ``tensor``'s bytes this process has mapped in memory (the
    present bit of Linux's /proc/self/pagemap; the page cache may still hold them)."""
    page = mmap.PAGESIZE
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    first, last = -(-start // page) * page, end // page * page
    assert last > first, "the tensor spans no whole page"
    pages = (last - first) // page
    with open("/proc/self/pagemap", "rb") as pagemap:
        pagemap.seek(first // page * 8)
        entries = struct.unpack(f"{pages}Q", pagemap.read(pages * 8))
    return sum(entry >> 63 for entry in entries)


def in_the_file(tensor: torch.Tensor) -> bool:
    start = tensor.data_ptr()
    return FileMappings().backs(start, start + tensor.numel() * tensor.element_size())


def test_a_page_the_process_wrote_to_is_never_lost(tmp_path):
    path = tmp_path / "weights.pt"
    torch.save({"w": torch.arange(64 * 1024, dtype=torch.float32)}, path)
    weight = torch.load(path, mmap=True)["w"]
    assert in_the_file(weight)
    weight[5000] = -1.0  # copy on write: this page is the process's own now
    assert page_out(weight, FileMappings()) > 0
    expected = torch.arange(64 * 1024, dtype=torch.float32)
    expected[5000] = -1.0
    assert torch.equal(weight, expected)  # clean pages read back from the file, ours kept
    assert page_out(torch.arange(64 * 1024, dtype=torch.float32), FileMappings()) == 0


def test_zeros_take_memory_only_where_written_and_discarded_pages_read_as_zeros():
    like = torch.zeros(1)
    buffer = pages.zeros((64, 1024, 64), like)  # 16 MB
    assert buffer.shape == (64, 1024, 64)
    assert resident_pages(buffer) == 0  # (reading would map the shared zero page: checked last)
    buffer[3] = 1.5  # 256 KB: 64 pages
    assert 60 <= resident_pages(buffer) <= 66
    assert pages.discard(buffer[3]) > 0
    assert resident_pages(buffer) <= 2
    assert not buffer.any()  # zeros again
    small = pages.zeros((4, 4), like)  # below the size of a mapping of its own
    assert small.shape == (4, 4) and not small.any()


def test_a_history_gives_its_outgrown_buffer_back_without_its_pages():
    layers, heads, head_dim, rows = 2, 4, 64, 64
    history = SelfAttentionHistory(layers, heads, head_dim)
    state: dict = {}
    like = torch.zeros(1, heads * head_dim)
    buffers = []
    for step in range(1, 60):
        window = history.advance(state, rows, step, like)
        window.keys_values[:, :rows, :, -1] = 1.0  # every row writes its step
        if not buffers or state["buffer"] is not buffers[-1]:
            buffers.append(state["buffer"])
    assert len(buffers) >= 2  # the window widened past the first buffer's room: it grew
    outgrown = [b for b in buffers if b.size(3) < state["buffer"].size(3)]
    assert outgrown and all(resident_pages(b) <= 2 for b in outgrown)
    assert resident_pages(state["buffer"]) > 0


def test_a_history_holds_the_fewest_pages_its_steps_need_decode_after_decode():
    layers, heads, head_dim, sentences, beam, steps = 1, 2, 64, 8, 5, 41
    history = SelfAttentionHistory(layers, heads, head_dim)
    like = torch.zeros(1, heads * head_dim)
    # each (layer, slot, head) keeps a run of columns of 256 bytes: 41 steps fill 3 pages of it
    most = -(-steps * head_dim * 4 // mmap.PAGESIZE)
    for _ in range(2):  # the second decode borrows the first one's buffers from the pool
        state: dict = {}
        for step in range(1, steps + 1):
            rows = sentences if step == 1 else sentences * beam
            if step > 1:
                history.reorder(state, torch.arange(rows) // beam if step == 2 else
                                torch.arange(rows))  # fmt: skip
            window = history.advance(state, rows, step, like)
            window.keys_values[:, :rows, :, -1] = 1.0
        buffer = state["buffer"]
        runs = 2 * layers * buffer.size(1) * heads
        assert resident_pages(buffer) <= most * runs
        del state


def test_a_memory_pool_grown_for_more_sentences_holds_memory_for_those_written_alone():
    """A pool grows to twice the sentences it holds (room to admit more without copying each
    time); the slots not yet written take no memory: its keys and values are zeros that take
    pages only where written."""
    embed, width = 256, 512  # 512 KB a sentence's keys, as much its values

    def encoded(sentences: int) -> dict:
        values = torch.ones(sentences, width, embed)
        memory = {"keys": values.transpose(1, 2).contiguous(), "values": values,
                  "bias": None, "scale": torch.ones(sentences, 1, 1)}  # fmt: skip
        return {"attention_memory": memory}

    pool = attention_memory_pool(embed)
    pool.write(0, encoded(2), slice(0, 2), width)
    pool.write(2, encoded(3), slice(0, 3), width)  # grown to 10 slots, 5 of them written
    keys, values = pool.memory["keys"], pool.memory["values"]
    assert keys.size(0) == values.size(0) == 10
    written = 5 * width * embed * 4 // mmap.PAGESIZE  # 640 pages of each
    for tensor in (keys, values):
        assert written <= resident_pages(tensor) <= written + 2
        assert tensor[:5].eq(1).all() and not tensor[5:].any()

"""Text corpora → fixed-length token blocks with labels, for probing, training and evaluation.

`sources` (where text comes from: files, folders, JSONL, built-in corpora) → `blocks` (packed
token blocks, views, the seeded split, batches) → `large_corpus` (corpora of any size through
Hugging Face datasets, and `corpus_blocks`, the entry point every runner reads a corpus with);
`tasks` (the task sequences of `adept-ext continual`) builds on all three; `pipeline` builds from a
runner's options what a run trains and evaluates on (`Corpora` for one domain, `TaskSequence`), for
both runners and a user's own loop.
"""
from .blocks import (BlockSet, ConcatBlocks, LazyBatches, PackedBlocks, TensorBlocks, batches, block_rows,
                     check_labels, document_bos, document_ids, first_blocks, interleave_blocks, mix_blocks,
                     pack_stream, pad_id, pad_rows, shuffled_view, split_blocks, split_indices, split_views,
                     TaggedBlocks, token_blocks)
from .pipeline import Corpora, TaskSequence, data_workers, domain_sources
from .large_corpus import BlockStream, StreamBatches, corpus_blocks, load_documents, packed_blocks, tokenize
from .sources import (BUILTIN_CORPORA, FILE_SUFFIXES, TEXT_SUFFIXES, bbc_news_labelled, bbc_news_texts, corpus_files,
                      iter_documents, load_texts, python_docs_texts, python_source_texts)

__all__ = ["BUILTIN_CORPORA", "BlockSet", "BlockStream", "ConcatBlocks", "Corpora", "FILE_SUFFIXES", "LazyBatches",
           "PackedBlocks", "StreamBatches", "TEXT_SUFFIXES", "TaskSequence", "data_workers", "domain_sources",
           "TaggedBlocks", "TensorBlocks", "batches", "bbc_news_labelled",
           "bbc_news_texts", "block_rows", "check_labels", "corpus_blocks", "corpus_files",
           "document_bos", "document_ids", "first_blocks", "interleave_blocks",
           "iter_documents", "load_documents", "load_texts", "mix_blocks", "pack_stream", "packed_blocks", "pad_id",
           "pad_rows", "python_docs_texts", "python_source_texts", "shuffled_view", "split_blocks", "split_indices",
           "split_views", "token_blocks", "tokenize"]

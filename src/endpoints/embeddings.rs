//! Embeddings (`POST /v1/embeddings`) as upstream calls: each input item is its own task.

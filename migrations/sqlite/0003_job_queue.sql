-- The queue in claim order: workers take the oldest queued jobs
-- (`WHERE state = 'queued' AND not_before <= now ORDER BY created_at, id`).
-- With only (state, not_before), every claim sorted the whole backlog while
-- holding the write lock; with this index it reads the first rows in order
-- and skips the few still backing off.
CREATE INDEX jobs_queue ON jobs (state, created_at, id);

-- The queue in claim order: workers take the oldest queued jobs
-- (`WHERE state = 'queued' AND not_before <= now ORDER BY created_at, id`).
-- With (state, not_before) the planner took the range on not_before and
-- sorted the whole backlog on every claim, while holding the write lock;
-- this index reads the first rows in order and skips the few still backing
-- off. The reconciler's `state = 'running'` lookups use its prefix.
DROP INDEX jobs_state_not_before;
CREATE INDEX jobs_queue ON jobs (state, created_at, id);

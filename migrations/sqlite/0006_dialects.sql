-- Each dialect carried natively (docs/design.md, "Endpoints: one core,
-- several dialects").
--
-- A job keeps its request in its own dialect (`chat`, `messages`,
-- `responses`, ...) with the client's headers that change the answer
-- (JSON object, or null).
ALTER TABLE jobs ADD COLUMN dialect TEXT NOT NULL DEFAULT 'chat';
ALTER TABLE jobs ADD COLUMN forwarded TEXT;
-- A stored response keeps its own turn once: with `format` 2, `turns`
-- holds this turn's items (its input, then the answer's output, as
-- Responses items), `previous_id` names the turn before, and `fingerprint`
-- the task whose cached answers a deletion removes. Rows of `format` 1
-- (written before) hold the whole conversation as chat messages.
ALTER TABLE responses ADD COLUMN format BIGINT NOT NULL DEFAULT 1;
ALTER TABLE responses ADD COLUMN previous_id TEXT;
ALTER TABLE responses ADD COLUMN fingerprint TEXT;

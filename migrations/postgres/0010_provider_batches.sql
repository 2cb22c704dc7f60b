-- A batch's lines sent to a provider's own Batch API: for each provider
-- batch, JSON of its provider, model and id, so that a driver resuming the
-- batch polls the same provider batch instead of sending the lines again.
-- Keep in step with the other backend's migrations.
ALTER TABLE batches ADD COLUMN upstream TEXT;

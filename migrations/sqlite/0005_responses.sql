-- Responses kept with `store: true` on `POST /v1/responses`, per tenant:
-- `GET /v1/responses/{id}` returns `body`, and `previous_response_id`
-- continues the conversation in `turns` (the chat messages up to and
-- including this answer, oldest first). Two tenants may hold the same id;
-- neither sees the other's. Deleted by the reconciler after the retention.
CREATE TABLE responses (
    tenant TEXT NOT NULL,
    id TEXT NOT NULL,
    body TEXT NOT NULL,
    turns TEXT NOT NULL,
    created_at BIGINT NOT NULL,
    PRIMARY KEY (tenant, id)
);
CREATE INDEX responses_created ON responses (created_at);

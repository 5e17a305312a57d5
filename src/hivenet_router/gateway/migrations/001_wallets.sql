-- Tenant wallets: one balance per tenant, the holds taken at admission, and an append-only
-- ledger of credits and charges. Applied once, in one transaction, by the first router that
-- starts against the database (gateway/ledger.py); its version is then in wallet_migrations.
--
-- Money is NUMERIC (exact), never a float. Invariants, checked by the reconciliation:
--   wallets.balance = sum(ledger.amount) of the tenant
--   wallets.held    = sum(holds.amount) of the tenant

CREATE TABLE wallets (
    tenant      text PRIMARY KEY,
    currency    char(3) NOT NULL,
    balance     numeric NOT NULL DEFAULT 0,
    held        numeric NOT NULL DEFAULT 0 CHECK (held >= 0),
    updated_at  timestamptz NOT NULL DEFAULT now()
);

-- One row per request admitted against a wallet, until it settles (or expires: a router
-- that died never settles its own). charge_id is the router's key for the request.
CREATE TABLE holds (
    charge_id   text PRIMARY KEY,
    request_id  text NOT NULL,
    tenant      text NOT NULL REFERENCES wallets (tenant),
    amount      numeric NOT NULL CHECK (amount >= 0),
    created_at  timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX holds_created_at ON holds (created_at);

-- Credits (positive) and charges (negative, or zero). A charge is keyed by charge_id, which
-- the router makes unique per admitted request: a settle retried after a timeout or from
-- the local pending store finds its row and changes nothing. request_id is the client's
-- X-Request-ID (clients may reuse one), kept for correlation only.
CREATE TABLE ledger (
    id             bigserial PRIMARY KEY,
    charge_id      text UNIQUE,
    request_id     text,
    tenant         text NOT NULL,
    kind           text NOT NULL CHECK (kind IN ('credit', 'charge')),
    amount         numeric NOT NULL,
    balance_after  numeric NOT NULL,
    currency       char(3) NOT NULL,
    model          text,
    input_tokens   integer,
    output_tokens  integer,
    note           text,
    created_at     timestamptz NOT NULL DEFAULT now(),
    CHECK ((kind = 'charge') = (charge_id IS NOT NULL))
);
CREATE INDEX ledger_tenant_id ON ledger (tenant, id DESC);
CREATE INDEX ledger_request_id ON ledger (request_id);

-- Append-only: a correction is a new row, never an edit.
CREATE FUNCTION ledger_append_only() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'the wallet ledger is append-only (% refused)', TG_OP;
END $$;
CREATE TRIGGER ledger_append_only BEFORE UPDATE OR DELETE ON ledger
    FOR EACH ROW EXECUTE FUNCTION ledger_append_only();
CREATE TRIGGER ledger_no_truncate BEFORE TRUNCATE ON ledger
    FOR EACH STATEMENT EXECUTE FUNCTION ledger_append_only();

-- Take a hold only while the wallet has something left (balance - held > 0): the check and
-- the hold are one row update, so concurrent requests (on any router) cannot both pass on
-- the same last cent. Returns 'held', 'no_wallet', 'currency:<wallet currency>' or
-- 'insufficient:<available>'.
CREATE FUNCTION wallet_hold(
    p_charge text, p_request text, p_tenant text, p_currency text, p_amount numeric
) RETURNS text LANGUAGE plpgsql AS $$
DECLARE
    w wallets%ROWTYPE;
BEGIN
    UPDATE wallets SET held = held + p_amount, updated_at = now()
     WHERE tenant = p_tenant AND currency = p_currency AND balance - held > 0;
    IF FOUND THEN
        INSERT INTO holds (charge_id, request_id, tenant, amount)
             VALUES (p_charge, p_request, p_tenant, p_amount);
        RETURN 'held';
    END IF;
    SELECT * INTO w FROM wallets WHERE tenant = p_tenant;
    IF NOT FOUND THEN
        RETURN 'no_wallet';
    END IF;
    IF w.currency <> p_currency THEN
        RETURN 'currency:' || w.currency;
    END IF;
    RETURN 'insufficient:' || (w.balance - w.held)::text;
END $$;

-- Settle one request, idempotently: release its hold (if one is still there) and, when
-- p_record, append its charge and take it from the balance. The wallet row is locked
-- first, so a second settle of the same charge (a retry racing the first) waits and then
-- sees the first one's row. A charge for a tenant without a wallet (let through while the
-- ledger was unreachable) opens one at zero in the charge's currency, so nothing is lost.
-- Returns 'settled', 'duplicate', 'released' or 'currency:<wallet currency>'.
CREATE FUNCTION wallet_settle(
    p_charge text, p_request text, p_tenant text, p_currency text, p_amount numeric,
    p_model text, p_input integer, p_output integer, p_record boolean
) RETURNS text LANGUAGE plpgsql AS $$
DECLARE
    w_currency text;
    v_released numeric;
    v_after numeric;
BEGIN
    IF p_record THEN
        INSERT INTO wallets (tenant, currency) VALUES (p_tenant, p_currency)
            ON CONFLICT (tenant) DO NOTHING;
    END IF;
    SELECT currency INTO w_currency FROM wallets WHERE tenant = p_tenant FOR UPDATE;
    IF NOT FOUND THEN
        RETURN 'released';  -- a release for a tenant without a wallet: nothing held
    END IF;
    IF p_record AND EXISTS (SELECT 1 FROM ledger WHERE charge_id = p_charge) THEN
        RETURN 'duplicate';
    END IF;
    IF p_record AND w_currency <> p_currency THEN
        RETURN 'currency:' || w_currency;
    END IF;
    DELETE FROM holds WHERE charge_id = p_charge RETURNING amount INTO v_released;
    UPDATE wallets
       SET balance = balance - CASE WHEN p_record THEN p_amount ELSE 0 END,
           held = held - COALESCE(v_released, 0),
           updated_at = now()
     WHERE tenant = p_tenant
     RETURNING balance INTO v_after;
    IF NOT p_record THEN
        RETURN 'released';
    END IF;
    INSERT INTO ledger (charge_id, request_id, tenant, kind, amount, balance_after, currency,
                        model, input_tokens, output_tokens)
         VALUES (p_charge, p_request, p_tenant, 'charge', -p_amount, v_after, w_currency,
                 p_model, p_input, p_output);
    RETURN 'settled';
END $$;

-- Add to a wallet, opening it at its first credit (in p_currency, or USD when NULL).
-- Returns the wallet's currency, balance and held; a currency other than the wallet's
-- changes nothing and returns the wallet as it is (the caller compares).
CREATE FUNCTION wallet_credit(p_tenant text, p_currency text, p_amount numeric, p_note text)
RETURNS TABLE (currency text, balance numeric, held numeric) LANGUAGE plpgsql AS $$
DECLARE
    w wallets%ROWTYPE;
BEGIN
    INSERT INTO wallets (tenant, currency) VALUES (p_tenant, COALESCE(p_currency, 'USD'))
        ON CONFLICT (tenant) DO NOTHING;
    SELECT * INTO w FROM wallets WHERE tenant = p_tenant FOR UPDATE;
    IF p_currency IS NOT NULL AND w.currency <> p_currency THEN
        RETURN QUERY SELECT w.currency::text, w.balance, w.held;
        RETURN;
    END IF;
    UPDATE wallets SET balance = wallets.balance + p_amount, updated_at = now()
     WHERE tenant = p_tenant RETURNING * INTO w;
    INSERT INTO ledger (tenant, kind, amount, balance_after, currency, note)
         VALUES (p_tenant, 'credit', p_amount, w.balance, w.currency, p_note);
    RETURN QUERY SELECT w.currency::text, w.balance, w.held;
END $$;

-- Release holds older than p_age (their router died, or lost the database for longer than
-- that): the wallet's held goes down by exactly what is deleted. The wallets are locked
-- first, in the order every other function locks (wallet, then hold), so a settle of one of
-- these holds at the same moment waits instead of deadlocking. Returns how many.
CREATE FUNCTION wallet_expire_holds(p_age interval) RETURNS integer LANGUAGE plpgsql AS $$
DECLARE
    v_cutoff timestamptz := now() - p_age;
    n integer;
BEGIN
    PERFORM 1 FROM wallets
      WHERE tenant IN (SELECT tenant FROM holds WHERE created_at < v_cutoff)
      ORDER BY tenant FOR UPDATE;
    WITH gone AS (
        DELETE FROM holds WHERE created_at < v_cutoff RETURNING tenant, amount
    ), per_tenant AS (
        SELECT tenant, sum(amount) AS amount, count(*) AS holds FROM gone GROUP BY tenant
    ), updated AS (
        UPDATE wallets w SET held = w.held - p.amount, updated_at = now()
          FROM per_tenant p WHERE w.tenant = p.tenant
        RETURNING p.holds
    )
    SELECT COALESCE(sum(holds), 0) INTO n FROM updated;
    RETURN n;
END $$;

-- The reconciliation, also for operators (`SELECT * FROM wallet_reconcile()`): one row per
-- wallet whose balance is not the sum of its ledger (or not its last balance_after), or
-- whose held is not the sum of its holds, and one per tenant with ledger rows but no
-- wallet. Run it in a REPEATABLE READ transaction for one consistent snapshot.
CREATE FUNCTION wallet_reconcile()
RETURNS TABLE (tenant text, balance numeric, ledger_sum numeric, last_balance_after numeric,
               held numeric, holds_sum numeric)
LANGUAGE sql STABLE AS $$
    SELECT * FROM (
        SELECT w.tenant, w.balance, COALESCE(l.total, 0),
               (SELECT x.balance_after FROM ledger x WHERE x.tenant = w.tenant
                 ORDER BY x.id DESC LIMIT 1),
               w.held, COALESCE(h.total, 0)
          FROM wallets w
          LEFT JOIN (SELECT g.tenant, sum(g.amount) AS total FROM ledger g GROUP BY g.tenant) l
                 ON l.tenant = w.tenant
          LEFT JOIN (SELECT g.tenant, sum(g.amount) AS total FROM holds g GROUP BY g.tenant) h
                 ON h.tenant = w.tenant
    ) AS r (tenant, balance, ledger_sum, last_balance_after, held, holds_sum)
     WHERE r.balance <> r.ledger_sum OR r.held <> r.holds_sum
        OR r.last_balance_after IS DISTINCT FROM
           CASE WHEN r.last_balance_after IS NULL THEN NULL ELSE r.balance END
    UNION ALL
    SELECT DISTINCT g.tenant, NULL::numeric, NULL::numeric, NULL::numeric, NULL::numeric,
           NULL::numeric
      FROM ledger g
     WHERE NOT EXISTS (SELECT 1 FROM wallets w WHERE w.tenant = g.tenant)
$$;

-- Credits keyed by an optional reference, so that a retried credit is applied once, and
-- the refresh of holds whose request is still running (a long stream outlives the expiry
-- of holds whose router died).
--
-- The unique index reads the ledger once while it is built (writes to the ledger wait);
-- on a ledger of many millions of rows, apply this release in a quiet moment.

ALTER TABLE ledger ADD COLUMN reference text;
CREATE UNIQUE INDEX ledger_tenant_reference ON ledger (tenant, reference)
    WHERE reference IS NOT NULL;

-- wallet_credit with a reference (NULL: none). A reference already used by this tenant
-- changes nothing and returns applied = false with the amount it was credited first. The
-- wallet row is locked before the reference is looked up, so two retries racing each other
-- cannot both credit. The 4-argument wallet_credit of 001 stays for older routers.
CREATE FUNCTION wallet_credit(
    p_tenant text, p_currency text, p_amount numeric, p_note text, p_reference text
) RETURNS TABLE (currency text, balance numeric, held numeric, applied boolean,
                 first_amount numeric)
LANGUAGE plpgsql AS $$
DECLARE
    w wallets%ROWTYPE;
    v_first numeric;
BEGIN
    INSERT INTO wallets (tenant, currency) VALUES (p_tenant, COALESCE(p_currency, 'USD'))
        ON CONFLICT (tenant) DO NOTHING;
    SELECT * INTO w FROM wallets WHERE tenant = p_tenant FOR UPDATE;
    IF p_reference IS NOT NULL THEN
        SELECT l.amount INTO v_first FROM ledger l
         WHERE l.tenant = p_tenant AND l.reference = p_reference;
        IF FOUND THEN
            RETURN QUERY SELECT w.currency::text, w.balance, w.held, false, v_first;
            RETURN;
        END IF;
    END IF;
    IF p_currency IS NOT NULL AND w.currency <> p_currency THEN
        RETURN QUERY SELECT w.currency::text, w.balance, w.held, false, NULL::numeric;
        RETURN;
    END IF;
    UPDATE wallets SET balance = wallets.balance + p_amount, updated_at = now()
     WHERE tenant = p_tenant RETURNING * INTO w;
    INSERT INTO ledger (tenant, kind, amount, balance_after, currency, note, reference)
         VALUES (p_tenant, 'credit', p_amount, w.balance, w.currency, p_note, p_reference);
    RETURN QUERY SELECT w.currency::text, w.balance, w.held, true, NULL::numeric;
END $$;

-- Make the holds of requests still in flight young again, those older than p_age, so
-- that wallet_expire_holds only releases the holds of routers that died. Only hold rows
-- are touched (no wallet): the lock order of the other functions is kept. Returns how many.
CREATE FUNCTION wallet_refresh_holds(p_charges text[], p_age interval)
RETURNS integer LANGUAGE sql AS $$
    WITH touched AS (
        UPDATE holds SET created_at = now()
         WHERE charge_id = ANY (p_charges) AND created_at < now() - p_age
        RETURNING 1
    )
    SELECT count(*)::integer FROM touched
$$;

-- wallet_hold holds at most what the wallet has available (balance less the other holds).
-- The router lowers a request's output bound to what that available amount pays for, so
-- the worst case it then allows fits in the hold; holding the worst case before that
-- lowering (a 2,000-token stream on a 535-token balance) left the wallet "available"
-- below zero while the request ran, and every other request of the tenant was refused
-- with 402 although the balance paid for them. The status and its detail are those of
-- 003 ('held:<available before this hold>').
CREATE OR REPLACE FUNCTION wallet_hold(
    p_charge text, p_request text, p_tenant text, p_currency text, p_amount numeric
) RETURNS text LANGUAGE plpgsql AS $$
DECLARE
    w wallets%ROWTYPE;
    v_available numeric;
    v_amount numeric;
BEGIN
    SELECT * INTO w FROM wallets
     WHERE tenant = p_tenant AND currency = p_currency AND balance - held > 0
       FOR UPDATE;
    IF FOUND THEN
        v_available := w.balance - w.held;
        v_amount := LEAST(p_amount, v_available);
        UPDATE wallets SET held = held + v_amount, updated_at = now()
         WHERE tenant = p_tenant;
        INSERT INTO holds (charge_id, request_id, tenant, amount)
             VALUES (p_charge, p_request, p_tenant, v_amount);
        RETURN 'held:' || v_available::text;
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

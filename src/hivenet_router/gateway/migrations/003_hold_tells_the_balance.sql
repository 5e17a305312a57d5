-- wallet_hold tells what the wallet had available when it took the hold ('held:<amount>',
-- balance less the holds before this one), so that the router can lower the request's
-- output bound to what the balance pays for. Routers of earlier releases read the status
-- up to its colon and keep working.
CREATE OR REPLACE FUNCTION wallet_hold(
    p_charge text, p_request text, p_tenant text, p_currency text, p_amount numeric
) RETURNS text LANGUAGE plpgsql AS $$
DECLARE
    w wallets%ROWTYPE;
BEGIN
    UPDATE wallets SET held = held + p_amount, updated_at = now()
     WHERE tenant = p_tenant AND currency = p_currency AND balance - held > 0
     RETURNING * INTO w;
    IF FOUND THEN
        INSERT INTO holds (charge_id, request_id, tenant, amount)
             VALUES (p_charge, p_request, p_tenant, p_amount);
        RETURN 'held:' || (w.balance - w.held + p_amount)::text;
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

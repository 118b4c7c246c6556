"""The operator's side: the admin API (plans, tenants, keys, prices, budgets), the usage ledger
over HTTP, and the budget webhook."""

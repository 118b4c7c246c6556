"""The Lua scripts of the Redis limiter: admit, settle, renew (see ``tenancy.redis_limiter``).

They mirror ``tenancy.bucket`` (rate limits), ``tenancy.billing`` (budget windows) and the
in-memory limiter line for line; the tests run the same cases against both backends.

Budget holds: an admitted request's worst case is written to the tenant's ``held`` hash under
its lease id (``"<budget key> <window> <amount>"`` lines), and a budget's reserved amount is the
sum of the holds of live leases, computed at each admission. A lease that expires (its gateway
died) is pruned with its hold, so a crashed holder can never leave a phantom reservation behind.
Every key a script touches is declared in KEYS (Redis Cluster routes on them). The ledger's
hourly hash depends on Redis's clock, which the caller cannot read in the same step: it names the
hashes of the hour it expects and of the hours either side (a call that crosses an hour boundary
uses the next), and the script, finding none of them (the gateway's clock is off by more than an
hour), writes nothing and answers that hour for a retry.

An admission is idempotent on its lease id and a settlement on its request id, so either may be
sent again after a connection broke under it (``tenancy.script_batcher``) without counting twice.
"""

from __future__ import annotations

from tenancy.billing import WINDOW_LUA

# Shared by every script. `now` comes from Redis TIME unless the caller passes a clock override
# (tests only; production passes ''). Numbers are written with %.17g so they round-trip exactly,
# and returned as strings because Redis truncates Lua numbers to integers.
PRELUDE = (
    """
if redis.replicate_commands then redis.replicate_commands() end
local function clock(override)
  if override ~= '' then return tonumber(override) end
  local t = redis.call('TIME')
  return tonumber(t[1]) + tonumber(t[2]) / 1000000
end
local function fmt(x) return string.format('%.17g', x) end
-- tenancy.bucket.refilled
local function refilled(key, now, cap, rate)
  local v = redis.call('HMGET', key, 'level', 'ts')
  if not v[1] then return cap end
  local elapsed = now - tonumber(v[2])
  if elapsed < 0 then elapsed = 0 end
  return math.min(cap, tonumber(v[1]) + elapsed * rate)
end
-- tenancy.bucket.wait_for
local function wait_for(level, amount, rate)
  if level >= amount then return 0 end
  return (amount - level) / rate
end
-- A missing bucket reads as full, so Redis may drop it once it would be full again.
local function store(key, now, level, cap, rate)
  redis.call('HSET', key, 'level', fmt(level), 'ts', fmt(now))
  redis.call('PEXPIRE', key, math.ceil((cap - level) / rate * 1000) + 1000)
end
-- Keep the lease set (and the budget holds beside it) as long as its latest lease.
local function keep_leases(key, held, now)
  local last = redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')
  if last[2] then
    local ms = math.ceil((tonumber(last[2]) - now) * 1000) + 1000
    redis.call('PEXPIRE', key, ms)
    redis.call('PEXPIRE', held, ms)
  end
end
-- A budget's use in window w (a use stored for an older window reads as 0).
local function budget_used(key, w)
  local v = redis.call('HMGET', key, 'w', 'used')
  if v[1] and tonumber(v[1]) == w then return tonumber(v[2]) or 0 end
  return 0
end
"""
    + WINDOW_LUA
)

# KEYS: tokens, requests, leases (of the request's lane: interactive or batch), held, the other
#       lane's leases, budget_1 .. budget_n
# ARGV: tokens, tokens_per_minute, requests_per_minute, max_concurrent, lease_id, ttl_s, now_override,
#       concurrency_retry_s, n, then per budget: limit, window code, worst-case amount
# -> {admitted '0'|'1', reason, retry_after_s, token_level, request_level, now
#     [, budget index, used, reserved, window]}   (the last four for a budget refusal)
ADMIT_SCRIPT = (
    PRELUDE
    + """
local tokens = tonumber(ARGV[1])
local tok_cap, req_cap = tonumber(ARGV[2]), tonumber(ARGV[3])
local max_leases, lease_id, ttl = tonumber(ARGV[4]), ARGV[5], tonumber(ARGV[6])
local now = clock(ARGV[7])
local tok_rate, req_rate = tok_cap / 60, req_cap / 60

-- Expired leases of both lanes go, and their budget holds with them.
for _, leases in ipairs({KEYS[3], KEYS[5]}) do
  local gone = redis.call('ZRANGEBYSCORE', leases, '-inf', fmt(now))
  for i = 1, #gone, 1000 do
    redis.call('HDEL', KEYS[4], unpack(gone, i, math.min(i + 999, #gone)))
  end
  redis.call('ZREMRANGEBYSCORE', leases, '-inf', fmt(now))
end
local num_leases = redis.call('ZCARD', KEYS[3])
local tok = refilled(KEYS[1], now, tok_cap, tok_rate)
local req = refilled(KEYS[2], now, req_cap, req_rate)
-- Sent again (its connection broke after Redis ran it): its lease is there; nothing taken twice.
if redis.call('ZSCORE', KEYS[3], lease_id) then
  return {'1', 'ok', '0', fmt(tok), fmt(req), fmt(now)}
end

-- Budgets first: a request that does not fit is refused whatever the rate limits say.
local n = tonumber(ARGV[9])
local holds = {}
if n > 0 then
  local reserved_by = {}
  for _, v in ipairs(redis.call('HVALS', KEYS[4])) do
    for k, w, a in string.gmatch(v, '(%S+) (%S+) (%S+)') do
      local id = k .. ' ' .. w
      reserved_by[id] = (reserved_by[id] or 0) + tonumber(a)
    end
  end
  for i = 1, n do
    local key = KEYS[5 + i]
    local limit, kind, amount = tonumber(ARGV[7 + 3 * i]), ARGV[8 + 3 * i], tonumber(ARGV[9 + 3 * i])
    local w = window_index(kind, now)
    local used = budget_used(key, w)
    local reserved = reserved_by[key .. ' ' .. fmt(w)] or 0
    if used + reserved + amount > limit then
      return {'0', 'budget', '0', fmt(tok), fmt(req), fmt(now), tostring(i), fmt(used), fmt(reserved), fmt(w)}
    end
    holds[#holds + 1] = key .. ' ' .. fmt(w) .. ' ' .. fmt(amount)
  end
end

-- tenancy.bucket.admission_step
if tokens > tok_cap then
  return {'0', 'too_large', '0', fmt(tok), fmt(req), fmt(now)}
end
local reason, retry = 'ok', 0
local checks = {
  {'tokens', tok < tokens, wait_for(tok, tokens, tok_rate)},
  {'requests', req < 1, wait_for(req, 1, req_rate)},
  {'concurrency', num_leases >= max_leases, tonumber(ARGV[8])},
}
for _, c in ipairs(checks) do
  if c[2] and (reason == 'ok' or c[3] > retry) then
    reason, retry = c[1], c[3]
  end
end
if reason ~= 'ok' then
  return {'0', reason, fmt(retry), fmt(tok), fmt(req), fmt(now)}
end
tok, req = tok - tokens, req - 1
store(KEYS[1], now, tok, tok_cap, tok_rate)
store(KEYS[2], now, req, req_cap, req_rate)
redis.call('ZADD', KEYS[3], fmt(now + ttl), lease_id)
if #holds > 0 then
  redis.call('HSET', KEYS[4], lease_id, table.concat(holds, '\\n'))
end
keep_leases(KEYS[3], KEYS[4], now)
return {'1', 'ok', '0', fmt(tok), fmt(req), fmt(now)}
"""
)

# KEYS: tokens, leases, usage, held, settled marker, ledger hours index, the ledger hashes of the
#       hour before, of the hour and of the hour after (ledger key prefix .. hour index),
#       budget_1 .. budget_n
# ARGV: lease_id ('' for an untracked lease), unused_tokens (reserved - used; may be < 0),
#       tokens_per_minute, prompt_tokens, completion_tokens, now_override, cached_tokens,
#       cost (micro-dollars), ledger field prefix ("model\tkey\tbatch\t"), ledger key prefix
#       ("{tenant:x}:ledger:"), ledger retention s, marker ttl s, n, then per budget: limit,
#       window code, amount, soft threshold ('' for none)
# -> {live '0'|'1', duplicate '0'|'1', index of each budget whose soft threshold this crossed...},
#    or {'hour', hour index} when none of KEYS[7..9] is this hour's ledger hash (nothing written)
# The marker makes a settlement idempotent on its request id: a retry of an attempt that ran
# (it timed out on the way back) finds it and changes nothing.
SETTLE_SCRIPT = (
    PRELUDE
    + """
local now = clock(ARGV[6])
local hour = math.floor(now / 3600)
local ledger = ARGV[10] .. fmt(hour)
if ledger ~= KEYS[8] and ledger ~= KEYS[7] and ledger ~= KEYS[9] then return {'hour', fmt(hour)} end
if not redis.call('SET', KEYS[5], '1', 'NX', 'EX', ARGV[12]) then
  return {'0', '1'}
end
local score = redis.call('ZSCORE', KEYS[2], ARGV[1])
local live = 0
if score then
  if tonumber(score) > now then live = 1 end
  redis.call('ZREM', KEYS[2], ARGV[1])
end
local unused = tonumber(ARGV[2])
if live == 1 and unused > 0 then
  local cap = tonumber(ARGV[3])
  local rate = cap / 60
  -- tenancy.bucket.refund
  local level = math.min(cap, refilled(KEYS[1], now, cap, rate) + unused)
  store(KEYS[1], now, level, cap, rate)
end

-- Budgets: charged in the window the request was admitted in, while that window lasts (a
-- request admitted before a reset does not count against the new window, which never held it).
local admitted_in = {}
local n = tonumber(ARGV[13])
local held = n > 0 and redis.call('HGET', KEYS[4], ARGV[1])  -- holds exist only with budgets
if held then
  redis.call('HDEL', KEYS[4], ARGV[1])
  for k, w in string.gmatch(held, '(%S+) (%S+) %S+') do admitted_in[k] = w end
end
local out = {tostring(live), '0'}
for i = 1, n do
  local key = KEYS[9 + i]
  local kind, amount, soft = ARGV[11 + 4 * i], tonumber(ARGV[12 + 4 * i]), ARGV[13 + 4 * i]
  local w = fmt(window_index(kind, now))
  if admitted_in[key] == nil or admitted_in[key] == w then
    local v = redis.call('HMGET', key, 'w', 'used', 'soft')
    local used = 0
    if v[1] == w then used = tonumber(v[2]) or 0 end
    local total = used + amount
    redis.call('HSET', key, 'w', w, 'used', fmt(total))
    if soft ~= '' and v[3] ~= w and total >= tonumber(soft) then
      redis.call('HSET', key, 'soft', w)
      out[#out + 1] = tostring(i)
    end
  end
end

redis.call('HINCRBY', KEYS[3], 'prompt_tokens', ARGV[4])
redis.call('HINCRBY', KEYS[3], 'completion_tokens', ARGV[5])
redis.call('HINCRBY', KEYS[3], 'requests', 1)

-- The ledger: one hash per tenant and hour, fields "<model>\t<key>\t<batch>\t<counter>".
local p = ARGV[9]
local first = redis.call('HINCRBY', ledger, p .. 'requests', 1) == 1
redis.call('HINCRBY', ledger, p .. 'input', ARGV[4])
redis.call('HINCRBY', ledger, p .. 'cached', ARGV[7])
redis.call('HINCRBY', ledger, p .. 'output', ARGV[5])
redis.call('HINCRBY', ledger, p .. 'cost', ARGV[8])
-- The hash's expiry (the hour's end plus the retention) and its entry in the hours index, so
-- that a read visits only hours with data: set by the hour's first settlement of this group
-- (the same values every time, so the later ones skip them).
if first then
  local keep = tonumber(ARGV[11])
  redis.call('EXPIRE', ledger, math.ceil((hour + 1) * 3600 - now) + keep)
  redis.call('ZADD', KEYS[6], hour, fmt(hour))
  redis.call('ZREMRANGEBYSCORE', KEYS[6], '-inf', '(' .. fmt(hour - math.ceil(keep / 3600) - 1))
end
return out
"""
)

# KEYS: leases, held. ARGV: lease_id, ttl_s, now_override -> 1 if renewed, 0 if the lease is gone
RENEW_SCRIPT = (
    PRELUDE
    + """
local now = clock(ARGV[3])
local score = redis.call('ZSCORE', KEYS[1], ARGV[1])
if not score or tonumber(score) <= now then return 0 end
redis.call('ZADD', KEYS[1], fmt(now + tonumber(ARGV[2])), ARGV[1])
keep_leases(KEYS[1], KEYS[2], now)
return 1
"""
)

# KEYS: budget_1 .. budget_n, held, leases, batch leases. ARGV: now_override, then per budget its
# window code -> {now, then per budget: used, reserved (by live leases only), window}
BUDGETS_SCRIPT = (
    PRELUDE
    + """
local now = clock(ARGV[1])
local n = #KEYS - 3
local reserved_by = {}
local held = redis.call('HGETALL', KEYS[n + 1])
for j = 1, #held, 2 do
  local expiry = redis.call('ZSCORE', KEYS[n + 2], held[j]) or redis.call('ZSCORE', KEYS[n + 3], held[j])
  if expiry and tonumber(expiry) > now then
    for k, w, a in string.gmatch(held[j + 1], '(%S+) (%S+) (%S+)') do
      local id = k .. ' ' .. w
      reserved_by[id] = (reserved_by[id] or 0) + tonumber(a)
    end
  end
end
local out = {fmt(now)}
for i = 1, n do
  local w = window_index(ARGV[1 + i], now)
  out[#out + 1] = fmt(budget_used(KEYS[i], w))
  out[#out + 1] = fmt(reserved_by[KEYS[i] .. ' ' .. fmt(w)] or 0)
  out[#out + 1] = fmt(w)
end
return out
"""
)

# KEYS: a tenant's hourly ledger hashes (prefix .. hour index) to read
# ARGV: ledger key prefix, first hour, bucket width in hours, group by model / key / batch ('1' or
#       '0' each), number of models to keep (0: all), the models, number of key ids (0: all), the ids
# -> {number of groups G, then per group its model, key id, batch ('' where not grouped by it),
#     then per (bucket, group) with data: bucket index, group number (1..G), requests, input,
#     cached, output, cost}
# Summed here so that a 30-day read returns a few thousand integers instead of every hash field.
# Integers stay exact in Lua's doubles up to 2^53 (9e15 tokens or micro-dollars a bucket).
SUM_SCRIPT = """
local prefix_len = #ARGV[1]
local first, width = tonumber(ARGV[2]), tonumber(ARGV[3])
local by_model, by_key, by_batch = ARGV[4] == '1', ARGV[5] == '1', ARGV[6] == '1'
local keep_models, keep_keys = nil, nil
local nm = tonumber(ARGV[7])
if nm > 0 then
  keep_models = {}
  for i = 1, nm do keep_models[ARGV[7 + i]] = true end
end
local nk = tonumber(ARGV[8 + nm])
if nk > 0 then
  keep_keys = {}
  for i = 1, nk do keep_keys[ARGV[8 + nm + i]] = true end
end
local counter = {requests = 1, input = 2, cached = 3, output = 4, cost = 5}
-- Each field name is parsed once: its group number (false: filtered out) and counter index.
local group_of, index_of = {}, {}
local group_id, groups, num_groups = {}, {}, 0
local cells, order = {}, {}
for _, key in ipairs(KEYS) do
  local bucket = math.floor((tonumber(string.sub(key, prefix_len + 1)) - first) / width)
  local row = cells[bucket]
  if not row then row = {}; cells[bucket] = row end
  local fields = redis.call('HGETALL', key)
  for j = 1, #fields, 2 do
    local name = fields[j]
    local gid = group_of[name]
    if gid == nil then
      local model, key_id, batch, c = string.match(name, '^(.*)\\t(.*)\\t(.*)\\t(.*)$')
      gid = false
      local kept = c and counter[c] and (not keep_models or keep_models[model])
      if kept and (not keep_keys or keep_keys[key_id]) then
        local m, k, b = by_model and model or '', by_key and key_id or '', by_batch and batch or ''
        local id = m .. '\\t' .. k .. '\\t' .. b
        gid = group_id[id]
        if not gid then
          num_groups = num_groups + 1
          gid = num_groups
          group_id[id] = gid
          groups[#groups + 1] = m
          groups[#groups + 1] = k
          groups[#groups + 1] = b
        end
        index_of[name] = counter[c]
      end
      group_of[name] = gid
    end
    if gid then
      local cell = row[gid]
      if not cell then
        cell = {0, 0, 0, 0, 0}
        row[gid] = cell
        order[#order + 1] = bucket
        order[#order + 1] = gid
      end
      local i = index_of[name]
      cell[i] = cell[i] + tonumber(fields[j + 1])
    end
  end
end
local out = {num_groups}
for _, v in ipairs(groups) do out[#out + 1] = v end
for j = 1, #order, 2 do
  local bucket, gid = order[j], order[j + 1]
  local cell = cells[bucket][gid]
  out[#out + 1] = bucket
  out[#out + 1] = gid
  for i = 1, 5 do out[#out + 1] = cell[i] end
end
return out
"""

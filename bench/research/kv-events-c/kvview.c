/* A compiled KV event view, to measure what following vLLM's events could cost without
   Python objects per block: msgpack parsed in place, chain hashes computed as
   mooncake_proxy's token_chain does (CPython 3.11's tuple hash of (position, tuple(ids))),
   flat open-addressing tables per engine, and the router's holders as one shared table.
   Prototype for bench figures only: int block hashes, one block size. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef uint64_t u64; typedef uint32_t u32; typedef int64_t i64;

/* --- CPython's hashes (3.8+): int < 2^61 - 1 hashes to itself; tuples with xxHash lanes */
#define XXP1 11400714785074694791ULL
#define XXP2 14029467366897019727ULL
#define XXP5 2870177450012600261ULL
#define ROT(x) (((x) << 31) | ((x) >> 33))
static inline u64 tuple_acc(u64 acc, u64 lane) { acc += lane * XXP2; acc = ROT(acc); return acc * XXP1; }
static inline i64 tuple_end(u64 acc, u64 len) {
    acc += len ^ (XXP5 ^ 3527539UL);
    if (acc == (u64)-1) return 1546275796;
    return (i64)acc;
}
static inline u64 int_hash(i64 v) { /* small non-negative ints only (token ids, positions) */
    return (u64)v;
}
/* hash((position, tuple(ids[0:size]))) */
static inline i64 block_hash(i64 position, const i64 *ids, int size) {
    u64 inner = XXP5;
    for (int i = 0; i < size; i++) inner = tuple_acc(inner, int_hash(ids[i]));
    i64 t = tuple_end(inner, size);
    u64 outer = XXP5;
    outer = tuple_acc(outer, int_hash(position));
    outer = tuple_acc(outer, (u64)t);
    return tuple_end(outer, 2);
}

/* --- open addressing, linear probing, backward-shift deletion; key 0 means empty */
static inline u64 slot_of(u64 key, u64 mask) { return (key * 0x9E3779B97F4A7C15ULL) >> 20 & mask; }
static inline u64 fix(u64 key) { return key ? key : 0x5bd1e9955bd1e995ULL; }

typedef struct { u64 key, chain; u32 position, pad; } Known;  /* vLLM hash -> chain, position */
typedef struct { u64 key; u32 count, pad; } Chain;             /* chain -> count */
typedef struct { u64 key; u32 holder, pad; } Holder;           /* chain -> holder slot (+1) or overflow */

typedef struct { Known *t; u64 mask, used; } KnownTable;
typedef struct { Chain *t; u64 mask, used; } ChainTable;
typedef struct { Holder *t; u64 mask, used; u64 (*over)[8]; u32 overs, cap; } Holders;

#define TABLE_OPS(NAME, TYPE, TABLE) \
static TYPE *NAME##_find(TABLE *h, u64 key) { \
    for (u64 i = slot_of(key, h->mask);; i = (i + 1) & h->mask) { \
        if (h->t[i].key == key) return &h->t[i]; \
        if (!h->t[i].key) return NULL; } } \
static void NAME##_grow(TABLE *h); \
static TYPE *NAME##_put(TABLE *h, u64 key, int *fresh) { \
    if ((h->used + 1) * 10 > (h->mask + 1) * 7) NAME##_grow(h); \
    for (u64 i = slot_of(key, h->mask);; i = (i + 1) & h->mask) { \
        if (h->t[i].key == key) { *fresh = 0; return &h->t[i]; } \
        if (!h->t[i].key) { h->t[i].key = key; h->used++; *fresh = 1; return &h->t[i]; } } } \
static void NAME##_del(TABLE *h, TYPE *e) { \
    u64 i = e - h->t, j = i; h->used--; \
    for (;;) { j = (j + 1) & h->mask; if (!h->t[j].key) break; \
        u64 k = slot_of(h->t[j].key, h->mask); \
        if ((j > i && (k <= i || k > j)) || (j < i && (k <= i && k > j))) { h->t[i] = h->t[j]; i = j; } } \
    memset(&h->t[i], 0, sizeof(TYPE)); } \
static void NAME##_init(TABLE *h, u64 cap) { h->t = calloc(cap, sizeof(TYPE)); h->mask = cap - 1; h->used = 0; } \
static void NAME##_grow(TABLE *h) { \
    TABLE n; NAME##_init(&n, (h->mask + 1) * 2); int f; \
    for (u64 i = 0; i <= h->mask; i++) if (h->t[i].key) { TYPE *e = NAME##_put(&n, h->t[i].key, &f); *e = h->t[i]; } \
    free(h->t); h->t = n.t; h->mask = n.mask; }
TABLE_OPS(known, Known, KnownTable)
TABLE_OPS(chains, Chain, ChainTable)
TABLE_OPS(holders, Holder, Holders)

typedef struct { KnownTable known; ChainTable chains; Holders *holders; u32 slot; int block_size; u64 unplaced, stored_total; } View;

/* --- holders: one slot (+1) in the entry; more than one, an index into 512-bit masks */
#define MANY 0x80000000u
static void hold(Holders *h, u64 chain, u32 slot) {
    int fresh; Holder *e = holders_put(h, chain, &fresh);
    if (fresh) { e->holder = slot + 1; return; }
    if (!(e->holder & MANY)) {
        if (h->overs == h->cap) { h->cap = h->cap ? h->cap * 2 : 1024; h->over = realloc(h->over, h->cap * sizeof *h->over); }
        u64 *m = h->over[h->overs]; memset(m, 0, 64); m[(e->holder - 1) >> 6] |= 1ULL << ((e->holder - 1) & 63);
        e->holder = MANY | h->overs++;
    }
    h->over[e->holder & ~MANY][slot >> 6] |= 1ULL << (slot & 63);
}
static void let_go(Holders *h, u64 chain, u32 slot) {
    Holder *e = holders_find(h, chain);
    if (!e) return;
    if (!(e->holder & MANY)) { if (e->holder == slot + 1) holders_del(h, e); return; }
    u64 *m = h->over[e->holder & ~MANY]; m[slot >> 6] &= ~(1ULL << (slot & 63));
    int any = 0; for (int i = 0; i < 8; i++) any |= m[i] != 0;
    if (!any) holders_del(h, e);  /* the overflow mask is left behind: a prototype */
}

static void chain_up(View *v, u64 chain) {
    int fresh; Chain *c = chains_put(&v->chains, chain, &fresh);
    if (fresh) { c->count = 1; if (v->holders) hold(v->holders, chain, v->slot); } else c->count++;
}
static void chain_down(View *v, u64 chain) {
    Chain *c = chains_find(&v->chains, chain);
    if (--c->count == 0) { chains_del(&v->chains, c); if (v->holders) let_go(v->holders, chain, v->slot); }
}

static void stored(View *v, int has_parent, u64 parent, const u64 *hashes, int n, const i64 *ids, int nids, int size, int limit) {
    if (size < v->block_size) return;
    u64 chain = 0; i64 position = 0;
    if (has_parent) {
        Known *w = known_find(&v->known, fix(parent));
        if (!w) { v->unplaced += n; return; }
        chain = w->chain; position = w->position + 1;
    }
    v->block_size = size;
    int blocks = nids / size; if (blocks > n) blocks = n; if (limit < blocks) blocks = limit;
    for (int i = 0; i < blocks; i++, position++) {
        chain ^= (u64)block_hash(position, ids + (i64)i * size, size);
        int fresh; Known *k = known_put(&v->known, fix(hashes[i]), &fresh);
        if (!fresh) continue;
        k->chain = fix(chain); k->position = (u32)position; v->stored_total++;
        chain_up(v, fix(chain));
    }
}
static void removed(View *v, const u64 *hashes, int n) {
    for (int i = 0; i < n; i++) {
        Known *k = known_find(&v->known, fix(hashes[i]));
        if (!k) continue;
        u64 chain = k->chain; known_del(&v->known, k); chain_down(v, chain);
    }
}

/* --- msgpack, the subset vLLM's batches use */
typedef struct { const uint8_t *p, *end; int bad; } Rd;
static inline u64 be(const uint8_t *p, int n) { u64 v = 0; for (int i = 0; i < n; i++) v = v << 8 | p[i]; return v; }
enum { NIL, INT, STR, ARR, MAP, OTHER };
typedef struct { int kind; i64 i; const uint8_t *s; u64 n; } Val;
static Val rd(Rd *r) {
    Val v = {OTHER, 0, 0, 0}; if (r->p >= r->end) { r->bad = 1; return v; }
    uint8_t b = *r->p++;
    if (b <= 0x7f) { v.kind = INT; v.i = b; }
    else if (b >= 0xe0) { v.kind = INT; v.i = (int8_t)b; }
    else if ((b & 0xf0) == 0x90) { v.kind = ARR; v.n = b & 15; }
    else if ((b & 0xf0) == 0x80) { v.kind = MAP; v.n = b & 15; }
    else if ((b & 0xe0) == 0xa0) { v.kind = STR; v.n = b & 31; v.s = r->p; r->p += v.n; }
    else switch (b) {
        case 0xc0: v.kind = NIL; break;
        case 0xc2: case 0xc3: v.kind = OTHER; break;
        case 0xcc: v.kind = INT; v.i = be(r->p, 1); r->p += 1; break;
        case 0xcd: v.kind = INT; v.i = be(r->p, 2); r->p += 2; break;
        case 0xce: v.kind = INT; v.i = be(r->p, 4); r->p += 4; break;
        case 0xcf: v.kind = INT; v.i = (i64)be(r->p, 8); r->p += 8; break;
        case 0xd0: v.kind = INT; v.i = (int8_t)be(r->p, 1); r->p += 1; break;
        case 0xd1: v.kind = INT; v.i = (int16_t)be(r->p, 2); r->p += 2; break;
        case 0xd2: v.kind = INT; v.i = (int32_t)be(r->p, 4); r->p += 4; break;
        case 0xd3: v.kind = INT; v.i = (i64)be(r->p, 8); r->p += 8; break;
        case 0xca: r->p += 4; break;
        case 0xcb: r->p += 8; break;
        case 0xd9: v.kind = STR; v.n = be(r->p, 1); r->p += 1; v.s = r->p; r->p += v.n; break;
        case 0xda: v.kind = STR; v.n = be(r->p, 2); r->p += 2; v.s = r->p; r->p += v.n; break;
        case 0xdc: v.kind = ARR; v.n = be(r->p, 2); r->p += 2; break;
        case 0xdd: v.kind = ARR; v.n = be(r->p, 4); r->p += 4; break;
        case 0xde: v.kind = MAP; v.n = be(r->p, 2); r->p += 2; break;
        default: r->bad = 1;
    }
    return v;
}
static void skip(Rd *r, Val v) {
    if (v.kind == ARR) for (u64 i = 0; i < v.n; i++) skip(r, rd(r));
    else if (v.kind == MAP) for (u64 i = 0; i < 2 * v.n; i++) skip(r, rd(r));
}
static int is(Val v, const char *s) { return v.kind == STR && v.n == strlen(s) && !memcmp(v.s, s, v.n); }

static u64 hashes_buf[4096]; static i64 ids_buf[65536];
/* one event, a map as vLLM 0.32 sends it */
static void event(View *v, Rd *r, Val m) {
    enum { STORED = 1, REMOVED, CLEARED } kind = 0;
    int nh = 0, nids = 0, size = 0, has_parent = 0, skipped = 0, limit = 1 << 30; u64 parent = 0;
    for (u64 f = 0; f < m.n; f++) {
        Val k = rd(r), x = rd(r);
        if (is(k, "type")) kind = is(x, "BlockStored") ? STORED : is(x, "BlockRemoved") ? REMOVED : CLEARED;
        else if (is(k, "block_hashes")) { for (u64 i = 0; i < x.n; i++) hashes_buf[nh++] = (u64)rd(r).i; }
        else if (is(k, "token_ids")) { for (u64 i = 0; i < x.n; i++) ids_buf[nids++] = rd(r).i; }
        else if (is(k, "parent_block_hash")) { has_parent = x.kind != NIL; parent = (u64)x.i; }
        else if (is(k, "block_size")) size = (int)x.i;
        else if (is(k, "medium")) skipped |= !(x.kind == NIL || is(x, "GPU"));
        else if (is(k, "group_idx")) skipped |= !(x.kind == NIL || (x.kind == INT && x.i == 0));
        else if (is(k, "lora_id") || is(k, "lora_name")) skipped |= x.kind != NIL && !(x.kind == INT && x.i == 0);
        else if (is(k, "extra_keys") && x.kind == ARR) {
            for (u64 i = 0; i < x.n; i++) { Val e = rd(r); if (e.kind != NIL && limit > (int)i) limit = (int)i; skip(r, e); }
        } else skip(r, x);
    }
    if (skipped) return;
    if (kind == STORED) stored(v, has_parent, parent, hashes_buf, nh, ids_buf, nids, size, limit);
    else if (kind == REMOVED) removed(v, hashes_buf, nh);
}
static void batch(View *v, const uint8_t *p, u64 n) {
    Rd r = {p, p + n, 0};
    Val b = rd(&r); if (b.kind != ARR || b.n < 2) return;
    skip(&r, rd(&r));  /* ts */
    Val events = rd(&r);
    for (u64 i = 0; i < events.n; i++) { Val e = rd(&r); if (e.kind == MAP) event(v, &r, e); else skip(&r, e); }
}

static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
static uint8_t *slurp(const char *path, u64 *n) {
    FILE *f = fopen(path, "rb"); fseek(f, 0, SEEK_END); *n = ftell(f); fseek(f, 0, SEEK_SET);
    uint8_t *b = malloc(*n); if (fread(b, 1, *n, f) != *n) exit(2); fclose(f); return b;
}

/* kvview PROMPTS BATCHES ENGINES HOLDERS(0/1) [DUMP]: fill every engine's view from PROMPTS (each
   prompt's first token the engine's), then apply BATCHES (u32 kind, u32 length, msgpack) to each
   engine in turn, timed */
int main(int argc, char **argv) {
    u64 np, nb; uint8_t *prompts = slurp(argv[1], &np), *batches = slurp(argv[2], &nb);
    int engines = atoi(argv[3]), with_holders = atoi(argv[4]);
    Holders h = {0}; holders_init(&h, 1 << 20);
    View *views = calloc(engines, sizeof(View));
    double t0 = now();
    for (int e = 0; e < engines; e++) {
        View *v = &views[e]; known_init(&v->known, 1 << 15); chains_init(&v->chains, 1 << 15);
        v->holders = with_holders ? &h : NULL; v->slot = e;
        /* prompts: u32 blocks, u32 size, then blocks u64 hashes and blocks*size i64 ids */
        for (const uint8_t *p = prompts; p < prompts + np;) {
            u32 blocks = ((u32 *)p)[0], size = ((u32 *)p)[1]; p += 8;
            const u64 *hs = (const u64 *)p; p += 8 * blocks;
            i64 *ids = (i64 *)p; p += 8 * (u64)blocks * size;
            i64 first = ids[0]; ids[0] = e;
            stored(v, 0, 0, hs, blocks, ids, blocks * size, size, 1 << 30);
            ids[0] = first;
        }
    }
    double filled = now();
    double spent[3] = {0}; u64 events[3] = {0};  /* stored, removed, step */
    for (const uint8_t *p = batches; p < batches + nb;) {
        u32 kind = ((u32 *)p)[0], len = ((u32 *)p)[1], blocks = ((u32 *)p)[2]; p += 12;
        double t = now();
        for (int e = 0; e < engines; e++) batch(&views[e], p, len);
        spent[kind] += now() - t; events[kind] += (u64)blocks * engines;
        p += len;
    }
    u64 held = 0; for (int e = 0; e < engines; e++) held += views[e].known.used;
    printf("engines %d holders %d: fill %.1f s; per block event: stored %.3f us, removed %.3f us, steps %.3f us; "
           "blocks held %llu, holders %llu, unplaced %llu\n", engines, with_holders, filled - t0,
           spent[0] / events[0] * 1e6, spent[1] / events[1] * 1e6, spent[2] / events[2] * 1e6,
           (unsigned long long)held, (unsigned long long)h.used, (unsigned long long)views[0].unplaced);
    if (argc > 5) {  /* engine 0's chains, for checking against HeldBlocks */
        FILE *f = fopen(argv[5], "w");
        for (u64 i = 0; i <= views[0].chains.mask; i++) if (views[0].chains.t[i].key) fprintf(f, "%lld\n", (long long)views[0].chains.t[i].key);
        fclose(f);
    }
    return 0;
}

/* shardrun.aggregate._fastfold: `ShardFold` and its line reader for one shard file, in C.
 *
 * The reference is the pure-Python fold (`_shard.py` fed by `report/_scan.py`); this module
 * computes the same summary for the common case, several times faster, and hands everything
 * else back: on any line it is not sure to read exactly as the reference would (not compact
 * JSON as shardrun writes it, a field of an unexpected type, an event of the older layout,
 * a value that could not be bucketed) `body()` raises `Fallback` and the caller folds the
 * whole file again in Python. So a file is folded by one implementation, never a mix.
 *
 * What it reads: one JSON object per line, no whitespace, keys without escapes, values that
 * are strings, numbers, true/false/null, or (for `itl_hist` only) a flat object of integer
 * counts. Strings with escapes or non-ASCII bytes are checked with orjson (the reference's
 * parser), so a line the reference would reject is never accepted here.
 *
 * The one intended difference: a distribution's `total` is summed in arrival order, where
 * the reference sums each batch of 4,096 sorted values; the two agree to float rounding.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <ctype.h>
#include <float.h>
#include <math.h>
#include <string.h>

#define PER_OCTAVE 8
#define SUB_US (-1)
#define B_MIN (-1)
#define B_MAX 1023 /* bucket of 2^127 us: anything larger falls back */
#define NB (B_MAX - B_MIN + 1)
#define N_SEGMENTS 6
#define N_DISTS 10 /* DIST_NAMES: 6 buckets, ttft, ttft_request, tpot, e2e */
#define D_TTFT 6
#define D_TTFT_REQUEST 7
#define D_TPOT 8
#define MAX_TRACKED_REASONS 256

static PyObject *Fallback;

/* ---- values of one line ------------------------------------------------------------------ */

enum { V_ABSENT = 0, V_NULL, V_TRUE, V_FALSE, V_INT, V_FLOAT, V_STR, V_OBJ };

typedef struct {
    int type;
    const char *p; /* strings: the bytes between the quotes; objects: from '{' to '}' */
    Py_ssize_t n;
    long long i;
    double d;
    int plain; /* a string without escapes and non-ASCII bytes */
} Val;

enum {
    K_EV, K_T, K_SPAN, K_PROMPT_CHARS, K_ATTEMPT, K_STATUS, K_WASTED, K_PROMPT_TOKENS,
    K_CONN_READY_T, K_REUSED, K_COMPLETION_TOKENS, K_ITL_HIST, K_LAST_TOKEN_T, K_FIRST_TOKEN_T,
    K_OUTCOME, K_REASON, K_CAUSE, K_WAIT, K_LAG, K_CAP, K_SHARD, K_PID, K_HOST, K_CACHED,
    K_REASONING, K_RESENT, K_USAGE_ESTIMATED, K_RPS, K_WHY, K_TPS, K_SEEDED, K_RESPLIT,
    K_TOKENS, K_AT_ONCE, N_KEYS
};


/* The key's index, by its length then a fixed-size compare (inlined by the compiler). */
static inline int key_index(const char *p, Py_ssize_t n) {
    switch (n) {
    case 1:
        if (memcmp(p, "t", 1) == 0) return K_T;
        return -1;
    case 2:
        if (memcmp(p, "ev", 2) == 0) return K_EV;
        return -1;
    case 3:
        if (memcmp(p, "lag", 3) == 0) return K_LAG;
        if (memcmp(p, "cap", 3) == 0) return K_CAP;
        if (memcmp(p, "pid", 3) == 0) return K_PID;
        if (memcmp(p, "rps", 3) == 0) return K_RPS;
        if (memcmp(p, "why", 3) == 0) return K_WHY;
        if (memcmp(p, "tps", 3) == 0) return K_TPS;
        return -1;
    case 4:
        if (memcmp(p, "span", 4) == 0) return K_SPAN;
        if (memcmp(p, "wait", 4) == 0) return K_WAIT;
        if (memcmp(p, "host", 4) == 0) return K_HOST;
        return -1;
    case 5:
        if (memcmp(p, "cause", 5) == 0) return K_CAUSE;
        if (memcmp(p, "shard", 5) == 0) return K_SHARD;
        return -1;
    case 6:
        if (memcmp(p, "status", 6) == 0) return K_STATUS;
        if (memcmp(p, "reused", 6) == 0) return K_REUSED;
        if (memcmp(p, "reason", 6) == 0) return K_REASON;
        if (memcmp(p, "resent", 6) == 0) return K_RESENT;
        if (memcmp(p, "seeded", 6) == 0) return K_SEEDED;
        if (memcmp(p, "tokens", 6) == 0) return K_TOKENS;
        return -1;
    case 7:
        if (memcmp(p, "attempt", 7) == 0) return K_ATTEMPT;
        if (memcmp(p, "outcome", 7) == 0) return K_OUTCOME;
        if (memcmp(p, "resplit", 7) == 0) return K_RESPLIT;
        if (memcmp(p, "at_once", 7) == 0) return K_AT_ONCE;
        return -1;
    case 8:
        if (memcmp(p, "itl_hist", 8) == 0) return K_ITL_HIST;
        return -1;
    case 12:
        if (memcmp(p, "prompt_chars", 12) == 0) return K_PROMPT_CHARS;
        if (memcmp(p, "conn_ready_t", 12) == 0) return K_CONN_READY_T;
        if (memcmp(p, "last_token_t", 12) == 0) return K_LAST_TOKEN_T;
        return -1;
    case 13:
        if (memcmp(p, "wasted_tokens", 13) == 0) return K_WASTED;
        if (memcmp(p, "prompt_tokens", 13) == 0) return K_PROMPT_TOKENS;
        if (memcmp(p, "cached_tokens", 13) == 0) return K_CACHED;
        if (memcmp(p, "first_token_t", 13) == 0) return K_FIRST_TOKEN_T;
        return -1;
    case 15:
        if (memcmp(p, "usage_estimated", 15) == 0) return K_USAGE_ESTIMATED;
        return -1;
    case 16:
        if (memcmp(p, "reasoning_tokens", 16) == 0) return K_REASONING;
        return -1;
    case 17:
        if (memcmp(p, "completion_tokens", 17) == 0) return K_COMPLETION_TOKENS;
        return -1;
    default:
        return -1;
    }
}

static PyObject *orjson_loads; /* the reference parser, for the rare hard strings */

/* A string with escapes or non-ASCII bytes: valid exactly when orjson reads it. */
static int check_hard_string(const char *quote, Py_ssize_t len_with_quotes) {
    PyObject *b = PyBytes_FromStringAndSize(quote, len_with_quotes);
    if (!b) return -1;
    PyObject *r = PyObject_CallOneArg(orjson_loads, b);
    Py_DECREF(b);
    if (!r) {
        PyErr_Clear();
        return 0;
    }
    int ok = PyUnicode_Check(r);
    Py_DECREF(r);
    return ok;
}

/* Any JSON number, by CPython's own correctly rounded reader (the one `float()` uses). */
static int slow_decimal(const char *start, const char *p, double *out) {
    char small[64], *buf = small;
    Py_ssize_t n = p - start;
    if (n >= (Py_ssize_t)sizeof(small) && !(buf = PyMem_Malloc((size_t)n + 1))) {
        PyErr_Clear();
        return 0;
    }
    memcpy(buf, start, (size_t)n);
    buf[n] = 0;
    char *stop = NULL;
    double d = PyOS_string_to_double(buf, &stop, NULL);
    int ok = !(d == -1.0 && PyErr_Occurred()) && stop == buf + n && isfinite(d);
    PyErr_Clear();
    if (buf != small) PyMem_Free(buf);
    if (!ok) return 0;
    *out = d;
    return 1;
}

/* The division behind fast numbers: w / 10^k for a decimal of at most 19 significant digits
 * and 27 decimals, read exactly as a correctly rounded reader does, without its big-number
 * arithmetic: both are exact in x87 extended precision, where the quotient is correctly
 * rounded to 64 bits, then rounded to double. Rounding twice can only go wrong when the first
 * result lies exactly halfway between two doubles (its 11 extra bits are 10000000000); those
 * take the general reader. Returns 1 with *out set, or 0. */
static inline int fast_quotient(unsigned long long w, int decimals, int neg, double *out) {
#if LDBL_MANT_DIG == 64 && defined(__x86_64__)
    static const long double P10[28] = {
        1e0L, 1e1L, 1e2L, 1e3L, 1e4L, 1e5L, 1e6L, 1e7L, 1e8L, 1e9L, 1e10L, 1e11L, 1e12L, 1e13L,
        1e14L, 1e15L, 1e16L, 1e17L, 1e18L, 1e19L, 1e20L, 1e21L, 1e22L, 1e23L, 1e24L, 1e25L,
        1e26L, 1e27L};
    if (decimals > 27) return 0;
    long double q = (long double)w / P10[decimals];
    /* x87 extended: the 64-bit significand is stored whole in the first 8 bytes */
    unsigned long long bits;
    memcpy(&bits, &q, sizeof(bits));
    if ((bits & 0x7FF) == 0x400) return 0;
    double d = (double)q;
    *out = neg ? -d : d;
    return 1;
#else
    return 0;
#endif
}

/* Parse a JSON number at *pp in one pass: the grammar is checked while the digits are
 * gathered; floats by `fast_quotient` where it applies, else by CPython's correctly rounded
 * reader. Returns 1, or 0 for anything else. */
static int parse_number(const char **pp, const char *end, Val *v) {
    const char *p = *pp, *start = p;
    int neg = 0, digits = 0, decimals = 0, exponent = 0;
    unsigned long long w = 0;
    if (*p == '-') {
        neg = 1;
        p++;
    }
    if (p >= end) return 0;
    if (*p == '0') {
        p++;
    } else if (*p >= '1' && *p <= '9') {
        while (p < end && *p >= '0' && *p <= '9') {
            if (++digits <= 19) w = w * 10 + (unsigned long long)(*p - '0');
            p++;
        }
    } else {
        return 0;
    }
    if (p < end && *p == '.') {
        p++;
        if (p >= end || *p < '0' || *p > '9') return 0;
        while (p < end && *p >= '0' && *p <= '9') {
            if (w || *p != '0') digits++; /* leading zeros are not significant */
            if (digits <= 19) w = w * 10 + (unsigned long long)(*p - '0');
            p++;
            decimals++;
        }
    }
    if (p < end && (*p == 'e' || *p == 'E')) {
        exponent = 1;
        p++;
        if (p < end && (*p == '+' || *p == '-')) p++;
        if (p >= end || *p < '0' || *p > '9') return 0;
        while (p < end && *p >= '0' && *p <= '9') p++;
    }
    if (decimals || exponent) {
        double d;
        if (exponent || digits > 19 || !fast_quotient(w, decimals, neg, &d)) {
            if (!slow_decimal(start, p, &d)) return 0;
        }
        v->type = V_FLOAT;
        v->d = d;
    } else {
        if (digits > 18) return 0;
        v->type = V_INT;
        v->i = neg ? -(long long)w : (long long)w;
        v->d = (double)v->i;
    }
    *pp = p;
    return 1;
}

/* Bytes that end the fast scan of a string: the quote, a backslash, control bytes, non-ASCII. */
static unsigned char STRING_STOP[256];

static void init_tables(void) {
    for (int c = 0; c < 256; c++) STRING_STOP[c] = c < 0x20 || c >= 0x80 || c == '"' || c == '\\';
}

/* A string at *pp (on its opening quote). Returns 1, 0 (not for us), -1 (Python error).
 * The line always ends before `end` (a newline follows it in the chunk), so the fast scan
 * stops at the latest on that newline (a control byte). */
static int parse_string(const char **pp, const char *end, Val *v) {
    const char *q = *pp, *p = q + 1;
    int plain = 1;
    for (;;) {
        /* eight bytes at a time while none is a quote, a backslash, < 0x20 or >= 0x80 */
        while (end - p >= 8) {
            unsigned long long x;
            memcpy(&x, p, 8);
            const unsigned long long ones = 0x0101010101010101ULL, high = 0x8080808080808080ULL;
            unsigned long long quote = x ^ (ones * '"'), slash = x ^ (ones * '\\');
            unsigned long long stop = ((quote - ones) & ~quote) | ((slash - ones) & ~slash) |
                                      (x - ones * 0x20) | x;
            if (stop & high) break;
            p += 8;
        }
        while (!STRING_STOP[(unsigned char)*p]) p++;
        if (p >= end || *p == '"') break;
        unsigned char c = (unsigned char)*p;
        if (c < 0x20) return 0;
        if (c == '\\') {
            plain = 0;
            p++;
            if (p >= end) return 0;
            if (*p == 'u') {
                if (end - p < 5) return 0;
                for (int k = 1; k <= 4; k++)
                    if (!isxdigit((unsigned char)p[k])) return 0;
                p += 4;
            } else if (*p == 0 || !strchr("\"\\/bfnrt", *p)) {
                return 0;
            }
        } else if (c >= 0x80) {
            plain = 0;
        }
        p++;
    }
    if (p >= end) return 0;
    if (!plain) {
        int ok = check_hard_string(q, p - q + 1);
        if (ok <= 0) return ok;
    }
    v->type = V_STR;
    v->p = q + 1;
    v->n = p - q - 1;
    v->plain = plain;
    *pp = p + 1;
    return 1;
}

/* `{"<int>":<int>,...}`, keys written as canonical integers: checked and skipped. */
static int skip_hist(const char **pp, const char *end, Val *v) {
    const char *p = *pp, *start = p;
    p++;
    if (p < end && *p == '}') {
        p++;
    } else {
        for (;;) {
            if (p >= end || *p != '"') return 0;
            p++;
            if (p < end && *p == '-') {
                p++;
                if (p < end && *p == '0') return 0; /* "-0": a key the C side would respell */
            }
            if (p >= end || *p < '0' || *p > '9') return 0;
            if (*p == '0' && p + 1 < end && p[1] != '"') return 0;
            while (p < end && *p >= '0' && *p <= '9') p++;
            if (p >= end || *p != '"') return 0;
            p++;
            if (p >= end || *p != ':') return 0;
            p++;
            Val n;
            if (!parse_number(&p, end, &n) || n.type != V_INT) return 0;
            if (p >= end) return 0;
            if (*p == '}') {
                p++;
                break;
            }
            if (*p != ',') return 0;
            p++;
        }
    }
    v->type = V_OBJ;
    v->p = start;
    v->n = p - start;
    *pp = p;
    return 1;
}

/* One line (without its newline) into vals. Returns 1, 0 (fall back), -1 (Python error). */
static int parse_line(const char *p, const char *end, Val *vals) {
    for (int k = 0; k < N_KEYS; k++) vals[k].type = V_ABSENT;
    if (p >= end || *p != '{') return 0;
    p++;
    if (p < end && *p == '}') return 0; /* no "ev": the reference calls it a bad line */
    for (;;) {
        Val key;
        if (p >= end || *p != '"') return 0;
        const char *close = p + 1;
        while (!STRING_STOP[(unsigned char)*close]) close++; /* at the latest: the newline */
        if (close >= end || *close != '"') return 0; /* escapes or non-ASCII: not ours */
        key.p = p + 1;
        key.n = close - p - 1;
        p = close + 1;
        int r;
        if (p >= end || *p != ':') return 0;
        p++;
        int k = key_index(key.p, key.n);
        if (k == K_EV && vals[K_EV].type != V_ABSENT) return 0;
        Val tmp, *v = k >= 0 ? &vals[k] : &tmp;
        v->plain = 0;
        if (p >= end) return 0;
        char c = *p;
        if (c == '"') {
            r = parse_string(&p, end, v);
            if (r <= 0) return r;
        } else if (c == '-' || (c >= '0' && c <= '9')) {
            if (!parse_number(&p, end, v)) return 0;
        } else if (c == 't' && end - p >= 4 && memcmp(p, "true", 4) == 0) {
            v->type = V_TRUE;
            p += 4;
        } else if (c == 'f' && end - p >= 5 && memcmp(p, "false", 5) == 0) {
            v->type = V_FALSE;
            p += 5;
        } else if (c == 'n' && end - p >= 4 && memcmp(p, "null", 4) == 0) {
            v->type = V_NULL;
            p += 4;
        } else if (c == '{' && k == K_ITL_HIST) {
            if (!skip_hist(&p, end, v)) return 0;
        } else {
            return 0;
        }
        if (p >= end) return 0;
        if (*p == '}') {
            p++;
            break;
        }
        if (*p != ',') return 0;
        p++;
    }
    return p == end ? 1 : 0;
}

/* A string value as the Python str the reference would see. New reference. */
static PyObject *str_of(const Val *v) {
    if (v->plain) return PyUnicode_FromStringAndSize(v->p, v->n);
    PyObject *b = PyBytes_FromStringAndSize(v->p - 1, v->n + 2);
    if (!b) return NULL;
    PyObject *r = PyObject_CallOneArg(orjson_loads, b);
    Py_DECREF(b);
    return r;
}

/* Any scalar value as the Python object orjson gives (None when absent). New reference. */
static PyObject *obj_of(const Val *v) {
    switch (v->type) {
    case V_ABSENT:
    case V_NULL: Py_RETURN_NONE;
    case V_TRUE: Py_RETURN_TRUE;
    case V_FALSE: Py_RETURN_FALSE;
    case V_INT: return PyLong_FromLongLong(v->i);
    case V_FLOAT: return PyFloat_FromDouble(v->d);
    case V_STR: return str_of(v);
    default: PyErr_SetString(Fallback, "nested value"); return NULL;
    }
}

/* ---- arithmetic the reference does in Python --------------------------------------------- */

/* Python's float floor division `x // y` (Objects/floatobject.c, float_floor_div). */
static double py_floordiv(double vx, double wx) {
    double mod = fmod(vx, wx);
    double div = (vx - mod) / wx;
    if (mod) {
        if ((wx < 0) != (mod < 0)) div -= 1.0;
    }
    double floordiv;
    if (div) {
        floordiv = floor(div);
        if (div - floordiv > 0.5) floordiv += 1.0;
    } else {
        floordiv = copysign(0.0, vx / wx);
    }
    return floordiv;
}

/* `_dist._bucket`: floor(log2(us) * PER_OCTAVE), SUB_US below 1 us; 0 when out of range. */
static int bucket_of(double x, int *b) {
    double us = x * 1e6;
    if (!(us >= 1.0)) {
        if (isnan(us)) return 0;
        *b = SUB_US;
        return 1;
    }
    double f = floor(log2(us) * PER_OCTAVE);
    if (!(f <= B_MAX)) return 0;
    *b = (int)f;
    return 1;
}

typedef struct {
    long long counts[NB];
    long long n;
    double total, lo, hi;
} Dist;

static void dist_init(Dist *d) {
    memset(d->counts, 0, sizeof(d->counts));
    d->n = 0;
    d->total = 0.0;
    d->lo = INFINITY;
    d->hi = -INFINITY;
}

static int dist_add(Dist *d, double x) {
    int b;
    if (!bucket_of(x, &b)) return 0;
    d->counts[b - B_MIN]++;
    d->n++;
    d->total += x;
    if (x < d->lo) d->lo = x;
    if (x > d->hi) d->hi = x;
    return 1;
}

typedef struct {
    Dist dists[N_DISTS];
    long long spans;
    long long itl[NB];
    unsigned char itl_seen[NB];
    int itl_order[NB]; /* buckets in order of first appearance, as the reference's dict */
    int itl_n;
} Segment;

/* ---- open spans ------------------------------------------------------------------------- */

typedef struct {
    double q, a, s, c, f;
    unsigned char has_q, has_a, has_s, has_c, has_f, has_e, has_pc, e_has_pt, e_has_last;
    unsigned char e_estimated; /* `usage_estimated` is true: the client counted the tokens */
    unsigned char e_one_piece; /* the answer came in under 2 content chunks (`tokens`) */
    unsigned char e_at_once;   /* `at_once` is true: no first token before the answer's end */
    unsigned char held;        /* a retry `rate_limited`: the server's rate limit held it */
    long long pc;
    /* the ok attempt_end: t, completion tokens, prompt tokens, itl_hist, last_token_t, line */
    double e_t, e_last;
    long long e_tokens, e_pt;
    PyObject *e_itl; /* bytes of the itl_hist object, or NULL */
    PyObject *e_raw; /* the attempt_end line (keep_lines only), or NULL */
} Span;

typedef struct {
    long long minute, tokens, spans, lines, est_spans, est_tokens;
    PyObject *sha;    /* hashlib object (keep_lines), or NULL */
    PyObject *update; /* its bound `update` */
} Minute;

/* ---- the open-span table: span id -> index into `spans` ------------------------------------ */

#define ID_MAX 46 /* longer span ids fall back */

typedef struct {
    unsigned long long hash;
    int index; /* -1: empty */
    unsigned char len;
    char id[ID_MAX + 1];
} Slot;

typedef struct {
    Slot *slots;
    size_t mask, used;
} Table;

static unsigned long long id_hash(const char *p, Py_ssize_t n) {
    unsigned long long h = 1469598103934665603ULL; /* FNV-1a */
    for (Py_ssize_t i = 0; i < n; i++) h = (h ^ (unsigned char)p[i]) * 1099511628211ULL;
    return h;
}

static int table_init(Table *t, size_t size) {
    t->slots = PyMem_Malloc(sizeof(Slot) * size);
    if (!t->slots) return -1;
    for (size_t i = 0; i < size; i++) t->slots[i].index = -1;
    t->mask = size - 1;
    t->used = 0;
    return 0;
}

/* The slot holding this id, or the empty slot where it would go. */
static Slot *table_find(Table *t, const char *p, Py_ssize_t n, unsigned long long h) {
    size_t i = (size_t)h & t->mask;
    for (;;) {
        Slot *slot = &t->slots[i];
        if (slot->index < 0 ||
            (slot->hash == h && slot->len == n && memcmp(slot->id, p, (size_t)n) == 0))
            return slot;
        i = (i + 1) & t->mask;
    }
}

static int table_grow(Table *t) {
    Table bigger;
    if (table_init(&bigger, (t->mask + 1) * 2) < 0) return -1;
    for (size_t i = 0; i <= t->mask; i++) {
        Slot *old = &t->slots[i];
        if (old->index < 0) continue;
        *table_find(&bigger, old->id, old->len, old->hash) = *old;
    }
    bigger.used = t->used;
    PyMem_Free(t->slots);
    *t = bigger;
    return 0;
}

/* Delete by shifting later entries of the probe run back (no tombstones). */
static void table_delete(Table *t, Slot *slot) {
    size_t i = (size_t)(slot - t->slots), j = i;
    t->slots[i].index = -1;
    for (;;) {
        j = (j + 1) & t->mask;
        if (t->slots[j].index < 0) break;
        size_t home = (size_t)t->slots[j].hash & t->mask;
        /* may the entry at j move to i? only if its home is not in (i, j] (cyclically) */
        int between = i <= j ? (home > i && home <= j) : (home > i || home <= j);
        if (!between) {
            t->slots[i] = t->slots[j];
            t->slots[j].index = -1;
            i = j;
        }
    }
    t->used--;
}

static void table_clear(Table *t) {
    for (size_t i = 0; i <= t->mask; i++) t->slots[i].index = -1;
    t->used = 0;
}

/* ---- the fold ----------------------------------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    int full, keep_lines;
    /* scheduler (`cap` is the scheduler's; `sum_cap` the summary's, 0 until a shard_start) */
    int cap, sum_cap;
    double idle_until;
    long long q, f;
    int has_last;
    double last, backlog, gap, busy_slots, cap_slots, idle;
    long long o; /* requests out, integrated on their own clock (`send_to`) */
    int has_sent_last;
    double sent_last, sending_slots;
    /* open spans */
    Table open;
    Span *spans;
    Py_ssize_t n_spans, cap_spans;
    Py_ssize_t *free_list;
    Py_ssize_t n_free;
    /* minutes */
    PyObject *minute_index; /* dict: minute (int) -> index */
    Minute *minutes;
    Py_ssize_t n_minutes, cap_minutes;
    long long last_minute;
    Py_ssize_t last_minute_at;
    PyObject *sha_factory, *reason_key;
    /* segments and loop lag */
    Segment *segments[N_SEGMENTS];
    Dist loop_lag;
    unsigned int itl_stamp[NB], itl_gen;
    /* the summary's counters (see `ShardSummary`) */
    PyObject *shard, *pid, *host, *by_status, *retries, *retry_minutes, *dead_reasons;
    PyObject *ok_key;
    long long starts, queued, ok, refusals, dead, abandoned, lost_at_restart, other_outcomes;
    long long ok_without_attempt, ok_incomplete, unknown_events, attempts, first_attempts;
    long long wasted_tokens, prompt_tokens, cached_tokens, reasoning_tokens, completion_tokens;
    long long estimated_ok, estimated_tokens;
    long long new_conns, reused_conns, resent;
    long long rate_waits;
    double rate_wait_first_s, rate_wait_retry_s;
    long long held_retries, limited_spans, learned_cuts, learned_seeds;
    int has_learned, has_tps, learned_seeded;
    double learned_rps, learned_tps;
    int ended, has_first, has_last_t;
    double first_t, last_t;
} Fold;

/* Scheduler._send_to */
static void send_to(Fold *s, double t) {
    if (s->has_sent_last && t > s->sent_last) {
        if (s->q > 0) {
            long long cap = s->cap > 0 ? s->cap : 0;
            long long out = s->o > 0 ? s->o : 0;
            if (out > cap) out = cap;
            s->sending_slots += (double)out * (t - s->sent_last);
        }
        s->sent_last = t;
    } else if (!s->has_sent_last) {
        s->sent_last = t;
        s->has_sent_last = 1;
    }
}

static void sched_move(Fold *s, double t, long long dq, long long df) {
    send_to(s, t);
    if (s->has_last && t > s->last) {
        if (s->q > 0) {
            double dt = t - s->last;
            s->backlog += dt;
            long long cap = s->cap > 0 ? s->cap : 0;
            s->cap_slots += (double)cap * dt;
            long long busy = s->f > 0 ? s->f : 0;
            if (busy > cap) busy = cap;
            s->busy_slots += (double)busy * dt;
            if (s->f < s->cap) s->gap += dt;
        } else if (s->f <= 0 && s->last < s->idle_until) {
            s->idle += (t < s->idle_until ? t : s->idle_until) - s->last;
        }
        s->last = t;
    } else if (!s->has_last) {
        s->last = t;
        s->has_last = 1;
    }
    s->q += dq;
    s->f += df;
}

static void seen(Fold *s, double t) {
    if (!s->has_first || t < s->first_t) {
        s->first_t = t;
        s->has_first = 1;
    }
    if (!s->has_last_t || t > s->last_t) {
        s->last_t = t;
        s->has_last_t = 1;
    }
}

static void span_clear(Span *sp) {
    Py_CLEAR(sp->e_itl);
    Py_CLEAR(sp->e_raw);
    memset(sp, 0, sizeof(Span));
}

/* The open span of this id; created (empty) when absent and `create`. -1: error, -2: none,
 * -3: an id too long for the table (fall back). */
static Py_ssize_t span_get(Fold *s, const Val *id, int create) {
    if (id->n > ID_MAX) return -3;
    unsigned long long h = id_hash(id->p, id->n);
    Slot *slot = table_find(&s->open, id->p, id->n, h);
    if (slot->index >= 0) return slot->index;
    if (!create) return -2;
    if ((s->open.used + 1) * 2 > s->open.mask + 1) {
        if (table_grow(&s->open) < 0) {
            PyErr_NoMemory();
            return -1;
        }
        slot = table_find(&s->open, id->p, id->n, h);
    }
    Py_ssize_t i;
    if (s->n_free) {
        i = s->free_list[--s->n_free];
    } else {
        if (s->n_spans == s->cap_spans) {
            Py_ssize_t cap = s->cap_spans ? s->cap_spans * 2 : 1024;
            Span *grown = PyMem_Realloc(s->spans, sizeof(Span) * (size_t)cap);
            if (grown) s->spans = grown;
            Py_ssize_t *fl = PyMem_Realloc(s->free_list, sizeof(Py_ssize_t) * (size_t)cap);
            if (fl) s->free_list = fl;
            if (!grown || !fl) {
                PyErr_NoMemory();
                return -1;
            }
            s->cap_spans = cap;
        }
        i = s->n_spans++;
        memset(&s->spans[i], 0, sizeof(Span));
    }
    slot->hash = h;
    slot->len = (unsigned char)id->n;
    memcpy(slot->id, id->p, (size_t)id->n);
    slot->index = (int)i;
    s->open.used++;
    return i;
}

/* A fresh span replacing any open one of this id (`queued`). */
static Py_ssize_t span_new(Fold *s, const Val *id) {
    Py_ssize_t i = span_get(s, id, 1);
    if (i >= 0) span_clear(&s->spans[i]);
    return i;
}

/* Remove and return the span of this id into *out (zeroed when absent); -3: id too long. */
static int span_pop(Fold *s, const Val *id, Span *out) {
    memset(out, 0, sizeof(Span));
    if (id->n > ID_MAX) return -3;
    Slot *slot = table_find(&s->open, id->p, id->n, id_hash(id->p, id->n));
    if (slot->index < 0) return 0;
    Py_ssize_t i = slot->index;
    table_delete(&s->open, slot);
    *out = s->spans[i]; /* takes the references */
    memset(&s->spans[i], 0, sizeof(Span));
    s->free_list[s->n_free++] = i;
    return 0;
}

static void clear_open(Fold *s) {
    for (Py_ssize_t i = 0; i < s->n_spans; i++) span_clear(&s->spans[i]);
    s->n_spans = 0;
    s->n_free = 0;
    table_clear(&s->open);
}

static int count_minute(Fold *s, double last, long long tokens, int estimated,
                        PyObject *end_raw, PyObject *raw) {
    double m = py_floordiv(last, 60.0);
    if (!(fabs(m) < 9e15)) return 0;
    long long minute = (long long)m;
    Py_ssize_t at;
    if (s->n_minutes && minute == s->last_minute) {
        at = s->last_minute_at;
    } else {
        PyObject *key = PyLong_FromLongLong(minute);
        if (!key) return -1;
        PyObject *found = PyDict_GetItemWithError(s->minute_index, key);
        if (found) {
            at = PyLong_AsSsize_t(found);
        } else if (PyErr_Occurred()) {
            Py_DECREF(key);
            return -1;
        } else {
            if (s->n_minutes == s->cap_minutes) {
                Py_ssize_t cap = s->cap_minutes ? s->cap_minutes * 2 : 64;
                Minute *grown = PyMem_Realloc(s->minutes, sizeof(Minute) * (size_t)cap);
                if (!grown) {
                    Py_DECREF(key);
                    PyErr_NoMemory();
                    return -1;
                }
                s->minutes = grown;
                s->cap_minutes = cap;
            }
            at = s->n_minutes++;
            memset(&s->minutes[at], 0, sizeof(Minute));
            s->minutes[at].minute = minute;
            PyObject *index = PyLong_FromSsize_t(at);
            if (!index || PyDict_SetItem(s->minute_index, key, index) < 0) {
                Py_XDECREF(index);
                Py_DECREF(key);
                return -1;
            }
            Py_DECREF(index);
        }
        Py_DECREF(key);
        s->last_minute = minute;
        s->last_minute_at = at;
    }
    Minute *cell = &s->minutes[at];
    cell->tokens += tokens;
    cell->spans += 1;
    if (estimated) {
        cell->est_spans += 1;
        cell->est_tokens += tokens;
    }
    if (s->keep_lines) {
        if (!cell->sha) {
            cell->sha = PyObject_CallNoArgs(s->sha_factory);
            if (!cell->sha) return -1;
            cell->update = PyObject_GetAttrString(cell->sha, "update");
            if (!cell->update) return -1;
        }
        PyObject *lines[2] = {end_raw, raw};
        for (int k = 0; k < 2; k++) {
            PyObject *r = PyObject_CallOneArg(cell->update, lines[k]);
            if (!r) return -1;
            Py_DECREF(r);
        }
        cell->lines += 2;
    }
    return 1;
}

/* `_segments.segment_of`. */
static int segment_of(int has_pt, long long pt, int has_pc, long long pc) {
    long long n;
    if (has_pt) {
        n = pt;
    } else {
        long long chars = has_pc ? pc : 0;
        /* -(-chars // 4) with Python's floor division */
        long long neg = -chars, fl = neg / 4;
        if ((neg % 4 != 0) && ((neg < 0) != (4 < 0))) fl -= 1;
        n = -fl;
    }
    if (n < 64) return 0;
    int bits = 64 - __builtin_clzll((unsigned long long)n);
    int i = (bits - 7) / 2 + 1;
    return i < N_SEGMENTS - 1 ? i : N_SEGMENTS - 1;
}

/* `stamp`/`gen` find a key twice in one object: orjson keeps the last value, which this
 * does not do; such a line falls back. */
static int add_itl(Segment *seg, PyObject *hist, unsigned int *stamp, unsigned int gen) {
    const char *p = PyBytes_AS_STRING(hist), *end = p + PyBytes_GET_SIZE(hist);
    p++; /* '{' */
    while (p < end && *p == '"') {
        p++;
        int neg = 0;
        if (*p == '-') {
            neg = 1;
            p++;
        }
        long long b = 0;
        while (*p >= '0' && *p <= '9') {
            b = b * 10 + (*p - '0');
            if (b > 100000) return 0;
            p++;
        }
        if (neg) b = -b;
        p += 2; /* '":' */
        long long c = 0;
        int cneg = 0;
        if (*p == '-') {
            cneg = 1;
            p++;
        }
        while (*p >= '0' && *p <= '9') c = c * 10 + (*p++ - '0');
        if (cneg) c = -c;
        if (b < B_MIN || b > B_MAX) return 0;
        int at = (int)b - B_MIN;
        if (stamp[at] == gen) return 0;
        stamp[at] = gen;
        if (!seg->itl_seen[at]) {
            seg->itl_seen[at] = 1;
            seg->itl_order[seg->itl_n++] = (int)b;
        }
        seg->itl[at] += c;
        if (*p == ',') p++;
    }
    return 1;
}

static int latency(Fold *s, Span *sp, double t_rel, double last, long long tokens) {
    if (!sp->has_q || !sp->has_a || !sp->has_s) {
        s->ok_incomplete++;
        return 1;
    }
    double q = sp->q, a = sp->a, st = sp->s;
    double c = sp->has_c ? sp->c : st;
    double f = sp->has_f ? sp->f : last;
    int i = segment_of(sp->e_has_pt, sp->e_pt, sp->has_pc, sp->pc);
    Segment *seg = s->segments[i];
    if (!seg) {
        seg = s->segments[i] = PyMem_Calloc(1, sizeof(Segment));
        if (!seg) {
            PyErr_NoMemory();
            return -1;
        }
        for (int k = 0; k < N_DISTS; k++) dist_init(&seg->dists[k]);
    }
    seg->spans++;
    double v[N_DISTS] = {a - q, st - a, c - st, f - c, last - f, t_rel - last, f - q, f - st,
                         0.0, t_rel - q};
    for (int k = 0; k < N_DISTS; k++) {
        /* an answer that came at once has no first token of its own, and gaps of 0 */
        if (k == D_TPOT || (sp->e_at_once && (k == D_TTFT || k == D_TTFT_REQUEST))) continue;
        if (!dist_add(&seg->dists[k], v[k])) return 0;
    }
    if (!sp->e_at_once && !sp->e_one_piece && tokens >= 2 &&
        !dist_add(&seg->dists[D_TPOT], (last - f) / (double)(tokens - 1)))
        return 0;
    if (sp->e_itl && !add_itl(seg, sp->e_itl, s->itl_stamp, ++s->itl_gen)) return 0;
    return 1;
}

/* ---- events ------------------------------------------------------------------------------ */

#define NEED(cond)                                                                             \
    do {                                                                                       \
        if (!(cond)) return 0;                                                                 \
    } while (0)
#define IS_NUM(v) ((v).type == V_INT || (v).type == V_FLOAT)
#define IS_INT_OR_NONE(v) ((v).type == V_INT || (v).type == V_NULL || (v).type == V_ABSENT)
#define IS_FLOAT_OR_NONE(v) ((v).type == V_FLOAT || (v).type == V_NULL || (v).type == V_ABSENT)
#define PRESENT(v) ((v).type != V_NULL && (v).type != V_ABSENT)
#define IS_SPAN(v) ((v).type == V_STR && (v).plain)

static int streq(const Val *v, const char *s) {
    size_t n = strlen(s);
    return v->type == V_STR && v->plain && (size_t)v->n == n && memcmp(v->p, s, n) == 0;
}

static int add_count(PyObject *dict, PyObject *key, long long by) {
    PyObject *old = PyDict_GetItemWithError(dict, key);
    if (!old && PyErr_Occurred()) return -1;
    long long n = old ? PyLong_AsLongLong(old) : 0;
    if (n == -1 && PyErr_Occurred()) return -1;
    PyObject *val = PyLong_FromLongLong(n + by);
    if (!val) return -1;
    int r = PyDict_SetItem(dict, key, val);
    Py_DECREF(val);
    return r;
}

static int ev_shard_start(Fold *s, Val *v) {
    NEED(v[K_T].type == V_FLOAT);
    NEED(IS_INT_OR_NONE(v[K_CAP]));
    seen(s, v[K_T].d);
    PyObject *shard = obj_of(&v[K_SHARD]), *pid = obj_of(&v[K_PID]), *host = obj_of(&v[K_HOST]);
    if (!shard || !pid || !host) {
        Py_XDECREF(shard);
        Py_XDECREF(pid);
        Py_XDECREF(host);
        return PyErr_ExceptionMatches(Fallback) ? (PyErr_Clear(), 0) : -1;
    }
    Py_XSETREF(s->shard, shard);
    Py_XSETREF(s->pid, pid);
    Py_XSETREF(s->host, host);
    long long cap = v[K_CAP].type == V_INT && v[K_CAP].i ? v[K_CAP].i : s->cap;
    NEED(cap > -1000000000LL && cap < 1000000000LL);
    s->cap = s->sum_cap = (int)cap;
    s->starts++;
    s->ended = 0;
    s->lost_at_restart += (long long)s->open.used;
    clear_open(s);
    /* Scheduler.restart */
    s->q = 0;
    s->f = 0;
    s->last = v[K_T].d;
    s->has_last = 1;
    s->o = 0;
    s->sent_last = v[K_T].d;
    s->has_sent_last = 1;
    return 1;
}

static int ev_seen_only(Fold *s, Val *v) {
    NEED(v[K_T].type == V_FLOAT);
    seen(s, v[K_T].d);
    return 1;
}

static int ev_loop_lag(Fold *s, Val *v) {
    NEED(v[K_T].type == V_FLOAT && IS_NUM(v[K_LAG]));
    seen(s, v[K_T].d);
    double lag = v[K_LAG].d > 0.0 ? v[K_LAG].d : 0.0;
    return dist_add(&s->loop_lag, lag);
}

static int ev_queued(Fold *s, Val *v) {
    NEED(v[K_T].type == V_FLOAT && IS_SPAN(v[K_SPAN]) && IS_INT_OR_NONE(v[K_PROMPT_CHARS]));
    double t = v[K_T].d;
    Py_ssize_t i = span_new(s, &v[K_SPAN]);
    if (i < 0) return i == -3 ? 0 : -1;
    Span *sp = &s->spans[i];
    sp->q = t;
    sp->has_q = 1;
    if (v[K_PROMPT_CHARS].type == V_INT) {
        sp->pc = v[K_PROMPT_CHARS].i;
        sp->has_pc = 1;
    }
    s->queued++;
    if (!s->has_first) {
        s->first_t = t;
        s->has_first = 1;
    }
    sched_move(s, t, 1, 0);
    return 1;
}

static int ev_admitted(Fold *s, Val *v) {
    NEED(v[K_T].type == V_FLOAT && IS_SPAN(v[K_SPAN]));
    Py_ssize_t i = span_get(s, &v[K_SPAN], 1);
    if (i < 0) return i == -3 ? 0 : -1;
    s->spans[i].a = v[K_T].d;
    s->spans[i].has_a = 1;
    sched_move(s, v[K_T].d, -1, 1);
    return 1;
}

static int ev_attempt_start(Fold *s, Val *v) {
    NEED(v[K_T].type == V_FLOAT && IS_SPAN(v[K_SPAN]) && IS_INT_OR_NONE(v[K_ATTEMPT]));
    Py_ssize_t i = span_get(s, &v[K_SPAN], 1);
    if (i < 0) return i == -3 ? 0 : -1;
    Span *sp = &s->spans[i];
    sp->s = v[K_T].d;
    sp->has_s = 1;
    sp->has_c = sp->has_f = 0;
    send_to(s, v[K_T].d);
    s->o++;
    s->attempts++;
    if (v[K_ATTEMPT].type == V_INT && v[K_ATTEMPT].i == 1) s->first_attempts++;
    return 1;
}

static int ev_attempt_end(Fold *s, Val *v, const char *line, Py_ssize_t len) {
    Val *st = &v[K_STATUS];
    NEED(st->type == V_STR || !PRESENT(*st));
    NEED(IS_INT_OR_NONE(v[K_WASTED]) && IS_INT_OR_NONE(v[K_PROMPT_TOKENS]) &&
         IS_INT_OR_NONE(v[K_CACHED]) && IS_INT_OR_NONE(v[K_RESENT]));
    NEED(IS_FLOAT_OR_NONE(v[K_CONN_READY_T]));
    NEED(v[K_REUSED].type != V_INT && v[K_REUSED].type != V_FLOAT &&
         v[K_REUSED].type != V_STR && v[K_REUSED].type != V_OBJ);
    if (s->full && v[K_T].type == V_FLOAT) { /* a request no longer out */
        send_to(s, v[K_T].d);
        s->o--;
    }
    int ok = streq(st, "ok");
    PyObject *key;
    if (ok) {
        key = s->ok_key;
        Py_INCREF(key);
    } else {
        key = obj_of(st);
        if (!key) return -1;
    }
    int r = add_count(s->by_status, key, 1);
    Py_DECREF(key);
    if (r < 0) return -1;
    if (v[K_WASTED].type == V_INT) s->wasted_tokens += v[K_WASTED].i;
    if (v[K_PROMPT_TOKENS].type == V_INT) s->prompt_tokens += v[K_PROMPT_TOKENS].i;
    if (v[K_CACHED].type == V_INT) s->cached_tokens += v[K_CACHED].i;
    if (v[K_RESENT].type == V_INT) s->resent += v[K_RESENT].i;
    int conn = v[K_CONN_READY_T].type == V_FLOAT;
    if (conn) {
        if (v[K_REUSED].type == V_TRUE)
            s->reused_conns++;
        else
            s->new_conns++;
    }
    if (!ok) return 1;
    NEED(IS_SPAN(v[K_SPAN]) && v[K_T].type == V_FLOAT);
    NEED(IS_INT_OR_NONE(v[K_COMPLETION_TOKENS]) && IS_INT_OR_NONE(v[K_ATTEMPT]) &&
         IS_INT_OR_NONE(v[K_REASONING]) && IS_INT_OR_NONE(v[K_TOKENS]));
    if (v[K_REASONING].type == V_INT) s->reasoning_tokens += v[K_REASONING].i;
    NEED(IS_FLOAT_OR_NONE(v[K_LAST_TOKEN_T]) && IS_FLOAT_OR_NONE(v[K_FIRST_TOKEN_T]));
    NEED(v[K_ITL_HIST].type == V_OBJ || !PRESENT(v[K_ITL_HIST]));
    Py_ssize_t i = span_get(s, &v[K_SPAN], 1);
    if (i < 0) return i == -3 ? 0 : -1;
    Span *sp = &s->spans[i];
    if (conn && !sp->has_c) {
        sp->c = v[K_CONN_READY_T].d;
        sp->has_c = 1;
    }
    if (!sp->has_f && v[K_FIRST_TOKEN_T].type == V_FLOAT) {
        sp->f = v[K_FIRST_TOKEN_T].d;
        sp->has_f = 1;
    }
    sp->has_e = 1;
    sp->e_t = v[K_T].d;
    sp->e_tokens = v[K_COMPLETION_TOKENS].type == V_INT ? v[K_COMPLETION_TOKENS].i : 0;
    sp->e_has_pt = v[K_PROMPT_TOKENS].type == V_INT;
    sp->e_pt = v[K_PROMPT_TOKENS].i;
    sp->e_has_last = v[K_LAST_TOKEN_T].type == V_FLOAT;
    sp->e_last = v[K_LAST_TOKEN_T].d;
    sp->e_estimated = v[K_USAGE_ESTIMATED].type == V_TRUE; /* `is True` in the reference */
    sp->e_one_piece = v[K_TOKENS].type == V_INT && v[K_TOKENS].i < 2;
    sp->e_at_once = v[K_AT_ONCE].type == V_TRUE;
    Py_CLEAR(sp->e_itl);
    /* `if itl:` in the reference: an empty object adds nothing */
    if (v[K_ITL_HIST].type == V_OBJ && v[K_ITL_HIST].n > 2) {
        sp->e_itl = PyBytes_FromStringAndSize(v[K_ITL_HIST].p, v[K_ITL_HIST].n);
        if (!sp->e_itl) return -1;
    }
    Py_CLEAR(sp->e_raw);
    if (s->keep_lines) {
        sp->e_raw = PyBytes_FromStringAndSize(line, len + 1); /* with its newline */
        if (!sp->e_raw) return -1;
    }
    return 1;
}

static int ev_released(Fold *s, Val *v, const char *line, Py_ssize_t len) {
    NEED(v[K_T].type == V_FLOAT && IS_SPAN(v[K_SPAN]));
    Val *out = &v[K_OUTCOME];
    NEED(out->type == V_STR || !PRESENT(*out));
    /* An ok line's reason says whether the answer was a refusal: compared plain, so one with
     * escapes goes to the reference. */
    NEED(!streq(out, "ok") || v[K_REASON].type != V_STR || v[K_REASON].plain);
    double t = v[K_T].d;
    if (!s->has_last_t || t > s->last_t) {
        s->last_t = t;
        s->has_last_t = 1;
    }
    if (s->full) sched_move(s, t, 0, -1);
    Span sp;
    int popped = span_pop(s, &v[K_SPAN], &sp);
    if (popped < 0) return popped == -3 ? 0 : -1;
    int result = 1;
    if (streq(out, "ok")) {
        if (!sp.has_e) {
            s->ok_without_attempt++;
        } else {
            s->ok++;
            if (streq(&v[K_REASON], "refusal")) s->refusals++;
            s->completion_tokens += sp.e_tokens;
            if (sp.e_estimated) {
                s->estimated_ok++;
                s->estimated_tokens += sp.e_tokens;
            }
            double last = sp.e_has_last ? sp.e_last : sp.e_t;
            PyObject *raw = NULL;
            if (s->keep_lines) {
                raw = PyBytes_FromStringAndSize(line, len + 1);
                if (!raw) result = -1;
            }
            if (result > 0)
                result = count_minute(s, last, sp.e_tokens, sp.e_estimated, sp.e_raw, raw);
            Py_XDECREF(raw);
            if (result > 0 && s->full) result = latency(s, &sp, t, last, sp.e_tokens);
        }
    } else if (streq(out, "abandoned")) {
        s->abandoned++;
    } else if (!streq(out, "dead")) {
        s->other_outcomes++;
    } else {
        s->dead++;
        PyObject *reason = obj_of(&v[K_REASON]);
        PyObject *key = reason ? PyObject_CallOneArg(s->reason_key, reason) : NULL;
        Py_XDECREF(reason);
        if (!key) {
            result = PyErr_ExceptionMatches(Fallback) ? (PyErr_Clear(), 0) : -1;
        } else {
            int has = PyDict_Contains(s->dead_reasons, key);
            if (has == 0 && PyDict_GET_SIZE(s->dead_reasons) >= MAX_TRACKED_REASONS) {
                Py_DECREF(key);
                key = PyUnicode_FromString("other");
            }
            if (has < 0 || !key || add_count(s->dead_reasons, key, 1) < 0) result = -1;
            Py_XDECREF(key);
        }
    }
    span_clear(&sp);
    return result;
}

static int ev_retry(Fold *s, Val *v) {
    NEED(v[K_T].type == V_FLOAT);
    Val *c = &v[K_CAUSE];
    PyObject *cause;
    if (c->type == V_STR) {
        cause = str_of(c);
    } else if (!PRESENT(*c)) {
        cause = PyUnicode_FromString("None");
    } else {
        return 0;
    }
    if (!cause) return -1;
    /* A hold for the server's rate limit is its why, not its cause (http_429 before holds
     * too); a why with escapes, and a held span that is no plain string, go to the reference. */
    int held = streq(&v[K_WHY], "rate_limited");
    if ((v[K_WHY].type == V_STR && !v[K_WHY].plain)
        || (held && !IS_SPAN(v[K_SPAN]) && PRESENT(v[K_SPAN]))) {
        Py_DECREF(cause);
        return 0;
    }
    int r = add_count(s->retries, cause, 1);
    double m = py_floordiv(v[K_T].d, 60.0);
    PyObject *minute = r < 0 ? NULL : PyLong_FromDouble(m);
    PyObject *per = NULL;
    if (minute) {
        per = PyDict_GetItemWithError(s->retry_minutes, minute);
        if (per) {
            Py_INCREF(per);
        } else if (!PyErr_Occurred()) {
            per = PyDict_New();
            if (per && PyDict_SetItem(s->retry_minutes, minute, per) < 0) Py_CLEAR(per);
        }
    }
    r = per ? add_count(per, cause, 1) : -1;
    Py_XDECREF(per);
    Py_XDECREF(minute);
    Py_DECREF(cause);
    if (r < 0) return -1;
    s->held_retries += held;
    if (held && PRESENT(v[K_SPAN])) { /* ShardFold._retry: once per open span */
        Py_ssize_t i = span_get(s, &v[K_SPAN], 0);
        if (i == -1) return -1;
        if (i >= 0 && !s->spans[i].held) {
            s->spans[i].held = 1;
            s->limited_spans++;
        }
    }
    return 1;
}

static int ev_rate_learned(Fold *s, Val *v) {
    /* ShardFold._rate_learned: a pace of requests (`rps`), of tokens (`tps`) or both; a line
     * with neither is ignored, one whose values are of another type is the reference's; a
     * re-split (`resplit`) sets the pace but counts as no seed or cut */
    Val *rps = &v[K_RPS], *tps = &v[K_TPS], *seeded = &v[K_SEEDED], *resplit = &v[K_RESPLIT];
    NEED(IS_NUM(*rps) || !PRESENT(*rps));
    NEED(IS_NUM(*tps) || !PRESENT(*tps));
    NEED(seeded->type == V_TRUE || seeded->type == V_FALSE || !PRESENT(*seeded));
    NEED(resplit->type == V_TRUE || resplit->type == V_FALSE || !PRESENT(*resplit));
    if (!IS_NUM(*rps) && !IS_NUM(*tps)) return 1;
    s->learned_seeded = seeded->type == V_TRUE;
    if (resplit->type != V_TRUE) {
        if (s->learned_seeded)
            s->learned_seeds++;
        else
            s->learned_cuts++;
    }
    s->has_learned = IS_NUM(*rps);
    s->learned_rps = s->has_learned ? rps->d : 0.0;
    s->has_tps = IS_NUM(*tps);
    s->learned_tps = s->has_tps ? tps->d : 0.0;
    return 1;
}

static int ev_rate_wait(Fold *s, Val *v) {
    NEED(IS_NUM(v[K_WAIT]) && IS_INT_OR_NONE(v[K_ATTEMPT]));
    s->rate_waits++;
    if (v[K_ATTEMPT].type == V_INT && v[K_ATTEMPT].i == 1)
        s->rate_wait_first_s += v[K_WAIT].d;
    else
        s->rate_wait_retry_s += v[K_WAIT].d;
    return 1;
}

/* One line: 1 done, 0 fall back, -1 Python error. *checkpoint: the line holds the bytes
 * `"ev":"checkpoint"`, the reader's rule for lines to check against the running hash. */
static int fold_line(Fold *s, const char *line, Py_ssize_t len, int *checkpoint) {
    Val v[N_KEYS];
    int r = parse_line(line, line + len, v);
    if (r <= 0) return r;
    Val *ev = &v[K_EV];
    NEED(ev->type == V_STR);
    NEED(v[K_T].type == V_FLOAT || v[K_T].type == V_INT); /* the reader's rule for every line */
    *checkpoint = streq(ev, "checkpoint");
    if (!ev->plain) { /* an event name with escapes: no event of ours */
        s->unknown_events += s->full;
        return 1;
    }
#define IS(name) (ev->n == (Py_ssize_t)sizeof(name) - 1 && memcmp(ev->p, name, ev->n) == 0)
    if (IS("attempt_end")) return ev_attempt_end(s, v, line, len);
    if (IS("released")) return ev_released(s, v, line, len);
    if (IS("loop_lag")) return ev_loop_lag(s, v);
    if (IS("checkpoint") || IS("shard_end")) {
        r = ev_seen_only(s, v);
        if (r > 0 && IS("shard_end")) s->ended = 1;
        return r;
    }
    if (IS("shard_start")) return ev_shard_start(s, v);
    if (IS("conn_ready") || IS("first_token") || IS("last_token")) return 0; /* older layout */
    if (!s->full) {
        /* minutes_only: the reference does not even parse the other events' lines */
        return 1;
    }
    if (IS("queued")) return ev_queued(s, v);
    if (IS("admitted")) return ev_admitted(s, v);
    if (IS("attempt_start")) return ev_attempt_start(s, v);
    if (IS("retry")) return ev_retry(s, v);
    if (IS("rate_wait")) return ev_rate_wait(s, v);
    if (IS("rate_learned")) return ev_rate_learned(s, v);
    if (IS("rate_uncapped")) return 1; /* ShardFold._no_figure: ours, read for no figure */
#undef IS
    s->unknown_events++;
    return 1;
}

/* ---- the Python type ----------------------------------------------------------------------- */

static int Fold_init(Fold *s, PyObject *args, PyObject *kw) {
    static char *names[] = {"cap", "idle_until", "minutes_only", "keep_lines", "sha_factory",
                            "reason_key", NULL};
    int cap = 0, minutes_only = 0, keep_lines = 0;
    double idle_until = INFINITY;
    PyObject *sha_factory, *reason_key;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "idppOO", names, &cap, &idle_until,
                                     &minutes_only, &keep_lines, &sha_factory, &reason_key))
        return -1;
    s->cap = cap;
    s->idle_until = idle_until;
    s->full = !minutes_only;
    s->keep_lines = keep_lines;
    Py_INCREF(sha_factory);
    s->sha_factory = sha_factory;
    Py_INCREF(reason_key);
    s->reason_key = reason_key;
    if (table_init(&s->open, 256) < 0) {
        PyErr_NoMemory();
        return -1;
    }
    s->minute_index = PyDict_New();
    s->by_status = PyDict_New();
    s->retries = PyDict_New();
    s->retry_minutes = PyDict_New();
    s->dead_reasons = PyDict_New();
    s->ok_key = PyUnicode_InternFromString("ok");
    Py_INCREF(Py_None);
    s->shard = Py_None;
    Py_INCREF(Py_None);
    s->pid = Py_None;
    Py_INCREF(Py_None);
    s->host = Py_None;
    dist_init(&s->loop_lag);
    if (!s->minute_index || !s->by_status || !s->retries || !s->retry_minutes ||
        !s->dead_reasons || !s->ok_key)
        return -1;
    return 0;
}

static void Fold_dealloc(Fold *s) {
    for (Py_ssize_t i = 0; i < s->n_spans; i++) span_clear(&s->spans[i]);
    PyMem_Free(s->spans);
    PyMem_Free(s->free_list);
    for (Py_ssize_t i = 0; i < s->n_minutes; i++) {
        Py_XDECREF(s->minutes[i].sha);
        Py_XDECREF(s->minutes[i].update);
    }
    PyMem_Free(s->minutes);
    for (int i = 0; i < N_SEGMENTS; i++) PyMem_Free(s->segments[i]);
    PyMem_Free(s->open.slots);
    Py_XDECREF(s->minute_index);
    Py_XDECREF(s->sha_factory);
    Py_XDECREF(s->reason_key);
    Py_XDECREF(s->shard);
    Py_XDECREF(s->pid);
    Py_XDECREF(s->host);
    Py_XDECREF(s->by_status);
    Py_XDECREF(s->retries);
    Py_XDECREF(s->retry_minutes);
    Py_XDECREF(s->dead_reasons);
    Py_XDECREF(s->ok_key);
    Py_TYPE(s)->tp_free((PyObject *)s);
}

/* body(chunk) -> (lines, checkpoints): fold every line of `chunk` (a bytes-like object that
 * ends with a newline); `checkpoints` lists (index, start, end) of the lines the reader checks
 * against the running hash: line index in the chunk, byte offsets of the line without its
 * newline. Raises Fallback on a line this fold does not read. */
static PyObject *Fold_body(Fold *s, PyObject *arg) {
    Py_buffer buf;
    if (PyObject_GetBuffer(arg, &buf, PyBUF_SIMPLE) < 0) return NULL;
    const char *base = buf.buf, *p = base, *end = base + buf.len;
    long long lineno = 0;
    PyObject *marks = PyList_New(0);
    if (!marks) goto fail;
    while (p < end) {
        const char *nl = memchr(p, '\n', (size_t)(end - p));
        if (!nl) {
            PyErr_SetString(PyExc_ValueError, "body() takes whole lines");
            goto fail;
        }
        int checkpoint = 0;
        int r = fold_line(s, p, nl - p, &checkpoint);
        if (r < 0) goto fail;
        if (r == 0) {
            PyErr_Format(Fallback, "line %lld of this chunk", lineno + 1);
            goto fail;
        }
        if (checkpoint) {
            PyObject *mark = Py_BuildValue("(Lnn)", lineno, (Py_ssize_t)(p - base),
                                           (Py_ssize_t)(nl - base));
            if (!mark || PyList_Append(marks, mark) < 0) {
                Py_XDECREF(mark);
                goto fail;
            }
            Py_DECREF(mark);
        }
        lineno++;
        p = nl + 1;
    }
    PyBuffer_Release(&buf);
    return Py_BuildValue("(LN)", lineno, marks);
fail:
    Py_XDECREF(marks);
    PyBuffer_Release(&buf);
    return NULL;
}

static PyObject *dist_tuple(const Dist *d) {
    PyObject *counts = PyDict_New();
    if (!counts) return NULL;
    for (int b = 0; b < NB; b++) {
        if (!d->counts[b]) continue;
        PyObject *k = PyLong_FromLong(b + B_MIN), *c = PyLong_FromLongLong(d->counts[b]);
        if (!k || !c || PyDict_SetItem(counts, k, c) < 0) {
            Py_XDECREF(k);
            Py_XDECREF(c);
            Py_DECREF(counts);
            return NULL;
        }
        Py_DECREF(k);
        Py_DECREF(c);
    }
    return Py_BuildValue("(NLddd)", counts, d->n, d->total, d->lo, d->hi);
}

static PyObject *opt_float(int has, double x) {
    if (has) return PyFloat_FromDouble(x);
    Py_RETURN_NONE;
}

/* finish(end_t): the raw summary as a dict; `_fast.py` turns it into a `ShardSummary`. */
static PyObject *Fold_finish(Fold *s, PyObject *arg) {
    if (arg != Py_None) {
        double end = PyFloat_AsDouble(arg);
        if (end == -1.0 && PyErr_Occurred()) return NULL;
        sched_move(s, end, 0, 0);
    } else if (s->has_last_t) {
        sched_move(s, s->last_t, 0, 0);
    }
    PyObject *minutes = PyDict_New(), *segments = PyDict_New();
    if (!minutes || !segments) goto fail;
    for (Py_ssize_t i = 0; i < s->n_minutes; i++) {
        Minute *m = &s->minutes[i];
        PyObject *sha = Py_None;
        if (m->sha) sha = PyObject_CallMethod(m->sha, "hexdigest", NULL);
        else Py_INCREF(sha);
        if (!sha) goto fail;
        PyObject *cell = Py_BuildValue("(LLLNLL)", m->tokens, m->spans, m->lines, sha,
                                       m->est_spans, m->est_tokens);
        PyObject *key = PyLong_FromLongLong(m->minute);
        if (!cell || !key || PyDict_SetItem(minutes, key, cell) < 0) {
            Py_XDECREF(cell);
            Py_XDECREF(key);
            goto fail;
        }
        Py_DECREF(cell);
        Py_DECREF(key);
    }
    for (int i = 0; i < N_SEGMENTS; i++) {
        Segment *seg = s->segments[i];
        if (!seg) continue;
        PyObject *dists = PyList_New(N_DISTS), *itl = PyDict_New();
        if (!dists || !itl) {
            Py_XDECREF(dists);
            Py_XDECREF(itl);
            goto fail;
        }
        for (int k = 0; k < N_DISTS; k++) {
            PyObject *d = dist_tuple(&seg->dists[k]);
            if (!d) {
                Py_DECREF(dists);
                Py_DECREF(itl);
                goto fail;
            }
            PyList_SET_ITEM(dists, k, d);
        }
        for (int j = 0; j < seg->itl_n; j++) {
            int b = seg->itl_order[j];
            PyObject *key = PyUnicode_FromFormat("%d", b);
            PyObject *c = PyLong_FromLongLong(seg->itl[b - B_MIN]);
            if (!key || !c || PyDict_SetItem(itl, key, c) < 0) {
                Py_XDECREF(key);
                Py_XDECREF(c);
                Py_DECREF(dists);
                Py_DECREF(itl);
                goto fail;
            }
            Py_DECREF(key);
            Py_DECREF(c);
        }
        PyObject *entry = Py_BuildValue("(LNN)", seg->spans, dists, itl);
        PyObject *key = PyLong_FromLong(i);
        if (!entry || !key || PyDict_SetItem(segments, key, entry) < 0) {
            Py_XDECREF(entry);
            Py_XDECREF(key);
            goto fail;
        }
        Py_DECREF(entry);
        Py_DECREF(key);
    }
    PyObject *lag = dist_tuple(&s->loop_lag);
    if (!lag) goto fail;
    return Py_BuildValue(
        "{s:O,s:O,s:O,s:i,s:L,s:O,s:N,s:N,s:L,s:L,s:L,s:n,s:L,s:L,s:L,s:L,s:L,s:L,s:L,s:L,"
        "s:O,s:O,s:O,s:O,s:L,s:L,s:L,s:L,s:L,s:L,s:L,s:d,s:d,s:d,s:d,s:d,s:d,s:d,s:d,s:N,s:N,"
        "s:N,s:L,s:L,s:L,s:L,s:L,s:L,s:L,s:L,s:L,s:N,s:L,s:N,s:O}",
        "shard", s->shard, "pid", s->pid, "host", s->host, "cap", s->sum_cap, "starts", s->starts,
        "ended", s->ended ? Py_True : Py_False, "first_t", opt_float(s->has_first, s->first_t),
        "last_t", opt_float(s->has_last_t, s->last_t), "queued", s->queued, "ok", s->ok,
        "dead", s->dead, "open_spans", (Py_ssize_t)s->open.used, "queue_depth", s->q,
        "in_flight", s->f, "abandoned", s->abandoned, "lost_at_restart", s->lost_at_restart,
        "other_outcomes", s->other_outcomes, "ok_without_attempt", s->ok_without_attempt,
        "ok_incomplete", s->ok_incomplete, "attempts", s->attempts, "by_status", s->by_status,
        "retries", s->retries, "retry_minutes", s->retry_minutes, "dead_reasons",
        s->dead_reasons, "first_attempts", s->first_attempts, "wasted_tokens", s->wasted_tokens,
        "prompt_tokens", s->prompt_tokens, "cached_tokens", s->cached_tokens, "completion_tokens", s->completion_tokens,
        "new_conns", s->new_conns, "reused_conns", s->reused_conns, "rate_wait_first_s",
        s->rate_wait_first_s, "rate_wait_retry_s", s->rate_wait_retry_s, "backlog_s",
        s->backlog, "gap_s", s->gap, "idle_s", s->idle, "busy_slot_s", s->busy_slots,
        "cap_slot_s", s->cap_slots, "sending_slot_s", s->sending_slots, "minutes", minutes, "segments", segments, "loop_lag", lag,
        "rate_waits", s->rate_waits, "refusals", s->refusals,
        "reasoning_tokens", s->reasoning_tokens, "resent", s->resent,
        "estimated_ok", s->estimated_ok, "estimated_tokens", s->estimated_tokens,
        "held_retries", s->held_retries, "limited_spans", s->limited_spans, "learned_cuts", s->learned_cuts, "learned_rps",
        opt_float(s->has_learned, s->learned_rps), "learned_seeds", s->learned_seeds,
        "learned_tps", opt_float(s->has_tps, s->learned_tps), "learned_seeded",
        s->learned_seeded ? Py_True : Py_False);
fail:
    Py_XDECREF(minutes);
    Py_XDECREF(segments);
    return NULL;
}

static PyObject *Fold_unknown(Fold *s, void *closure) {
    return PyLong_FromLongLong(s->unknown_events);
}

/* _number(b): one JSON number read as the fold reads it (for tests). */
static PyObject *number(PyObject *self, PyObject *arg) {
    if (!PyBytes_Check(arg)) {
        PyErr_SetString(PyExc_TypeError, "_number() takes bytes");
        return NULL;
    }
    const char *p = PyBytes_AS_STRING(arg), *end = p + PyBytes_GET_SIZE(arg);
    Val v;
    memset(&v, 0, sizeof(v));
    if (!parse_number(&p, end, &v) || p != end) {
        PyErr_SetString(PyExc_ValueError, "not a JSON number the fold reads");
        return NULL;
    }
    return v.type == V_INT ? PyLong_FromLongLong(v.i) : PyFloat_FromDouble(v.d);
}

static PyMethodDef module_methods[] = {
    {"_number", number, METH_O, "One JSON number as the fold reads it (for tests)."},
    {NULL},
};

static PyMethodDef Fold_methods[] = {
    {"body", (PyCFunction)Fold_body, METH_O, "Fold a chunk of whole lines: (lines, checkpoints)."},
    {"finish", (PyCFunction)Fold_finish, METH_O, "The raw summary, integrals run to end_t."},
    {NULL},
};

static PyGetSetDef Fold_getset[] = {
    {"unknown_events", (getter)Fold_unknown, NULL, "lines with an event name not ours", NULL},
    {NULL},
};

static PyTypeObject FoldType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "shardrun.aggregate._fastfold.Fold",
    .tp_basicsize = sizeof(Fold),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Fold_init,
    .tp_dealloc = (destructor)Fold_dealloc,
    .tp_methods = Fold_methods,
    .tp_getset = Fold_getset,
    .tp_doc = "One shard file's fold (see the module docstring).",
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_fastfold",
    "A C fold of one shard event file; the pure-Python fold is the reference.", -1,
    module_methods,
};

PyMODINIT_FUNC PyInit__fastfold(void) {
    init_tables();
    PyObject *orjson = PyImport_ImportModule("orjson");
    if (!orjson) return NULL;
    orjson_loads = PyObject_GetAttrString(orjson, "loads");
    Py_DECREF(orjson);
    if (!orjson_loads) return NULL;
    if (PyType_Ready(&FoldType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    Fallback = PyErr_NewException("shardrun.aggregate._fastfold.Fallback", NULL, NULL);
    if (!Fallback || PyModule_AddObjectRef(m, "Fallback", Fallback) < 0 ||
        PyModule_AddObjectRef(m, "Fold", (PyObject *)&FoldType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}

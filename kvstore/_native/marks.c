/*
 * Read marks of the owners sharing one store (issue 43; FORMAT.md, "owners/marks";
 * kvstore/io/marks.py binds this file with ctypes).  Plain C, no Python headers.
 *
 * Why native: a reader stores its mark and then loads LMDB's meta page (its lookup); a
 * ripener commits (stores the meta page) and then loads every mark.  That is the
 * store-buffer (Dekker) pattern, which x86 (TSO) and ARM both reorder unless each side
 * has a full fence between its store and its load.  CPython offers no fence, so the
 * publish and the minimum below carry one: with both, either the ripener sees the
 * reader's mark or the reader's lookup sees the ripener's commit.
 *
 * Words are naturally aligned u64 in a shared mapping; 0 means "no mark".
 */

#include <stddef.h>
#include <stdint.h>

#define KVS_MARKS_ABI 1

int kvs_marks_abi(void) { return KVS_MARKS_ABI; }

/* Store ``value`` into ``word``, then a sequentially consistent fence: the store is
   visible to every other thread and process before any load this thread makes after
   the call (the reader's lookup). */
void kvs_mark_publish(uint64_t *word, uint64_t value) {
    __atomic_store_n(word, value, __ATOMIC_RELAXED);
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
}

/* A sequentially consistent fence, then the smallest non-zero word of ``words[0..n)``
   (UINT64_MAX when every word is 0): every store the ripener made before the call (the
   commit it follows) is ordered before these loads. */
uint64_t kvs_marks_min(const uint64_t *words, size_t n) {
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    uint64_t lowest = UINT64_MAX;
    for (size_t i = 0; i < n; i++) {
        uint64_t v = __atomic_load_n(&words[i], __ATOMIC_RELAXED);
        if (v != 0 && v < lowest)
            lowest = v;
    }
    return lowest;
}

/* Raise ``word`` to ``value`` if it is lower (a shared high-water mark), atomically;
   returns the value it holds afterwards. */
uint64_t kvs_atomic_max(uint64_t *word, uint64_t value) {
    uint64_t seen = __atomic_load_n(word, __ATOMIC_RELAXED);
    while (seen < value &&
           !__atomic_compare_exchange_n(word, &seen, value, 0, __ATOMIC_SEQ_CST,
                                        __ATOMIC_RELAXED)) {
    }
    return seen < value ? value : seen;
}

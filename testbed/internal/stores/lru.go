package stores

import (
	"container/list"
	"sync"
)

// LRU is an in-process cache of at most Capacity entries, least recently used evicted first;
// the capacity changes at run time (cache_items on reload). Safe for concurrent use.
type LRU[K comparable, V any] struct {
	mu       sync.Mutex
	capacity int
	order    list.List // front = most recent; values are *entry[K, V]
	index    map[K]*list.Element
	hits     uint64
	misses   uint64
}

type entry[K comparable, V any] struct {
	key   K
	value V
}

// NewLRU returns an empty cache of capacity entries (at least 1).
func NewLRU[K comparable, V any](capacity int) *LRU[K, V] {
	return &LRU[K, V]{capacity: max(capacity, 1), index: map[K]*list.Element{}}
}

// Get returns the value of key and whether it was present.
func (c *LRU[K, V]) Get(key K) (V, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	el, ok := c.index[key]
	if !ok {
		c.misses++
		var zero V
		return zero, false
	}
	c.hits++
	c.order.MoveToFront(el)
	return el.Value.(*entry[K, V]).value, true
}

// Put stores value under key, evicting the least recently used entries beyond the capacity.
func (c *LRU[K, V]) Put(key K, value V) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if el, ok := c.index[key]; ok {
		el.Value.(*entry[K, V]).value = value
		c.order.MoveToFront(el)
		return
	}
	c.index[key] = c.order.PushFront(&entry[K, V]{key, value})
	c.evict()
}

// Resize changes the capacity (at least 1), evicting at once what no longer fits.
func (c *LRU[K, V]) Resize(capacity int) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.capacity = max(capacity, 1)
	c.evict()
}

// CacheStats is a snapshot of a cache.
type CacheStats struct {
	Capacity int    `json:"capacity"`
	Items    int    `json:"items"`
	Hits     uint64 `json:"hits"`
	Misses   uint64 `json:"misses"`
}

// Stats returns the capacity, size and hit counts.
func (c *LRU[K, V]) Stats() CacheStats {
	c.mu.Lock()
	defer c.mu.Unlock()
	return CacheStats{Capacity: c.capacity, Items: c.order.Len(), Hits: c.hits, Misses: c.misses}
}

func (c *LRU[K, V]) evict() {
	for c.order.Len() > c.capacity {
		el := c.order.Back()
		c.order.Remove(el)
		delete(c.index, el.Value.(*entry[K, V]).key)
	}
}

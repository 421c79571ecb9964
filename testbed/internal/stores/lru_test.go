package stores

import "testing"

func TestLRUEvictsLeastRecentlyUsed(t *testing.T) {
	c := NewLRU[int, string](2)
	c.Put(1, "a")
	c.Put(2, "b")
	c.Get(1) // 2 is now the least recently used
	c.Put(3, "c")
	if _, ok := c.Get(2); ok {
		t.Fatal("2 should have been evicted")
	}
	if v, ok := c.Get(1); !ok || v != "a" {
		t.Fatal("1 should remain")
	}
	c.Resize(1)
	if s := c.Stats(); s.Items != 1 || s.Capacity != 1 {
		t.Fatalf("%+v", s)
	}
	if _, ok := c.Get(1); !ok { // the most recent survives a shrink
		t.Fatal("1 should survive")
	}
	if s := c.Stats(); s.Hits != 3 || s.Misses != 1 {
		t.Fatalf("hit counts %+v", s)
	}
}

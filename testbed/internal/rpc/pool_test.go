package rpc

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

func TestPoolBoundsConcurrency(t *testing.T) {
	p := NewPool(3, 100)
	var active, peak atomic.Int64
	var wg sync.WaitGroup
	for range 40 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := p.Acquire(context.Background()); err != nil {
				t.Error(err)
				return
			}
			n := active.Add(1)
			for {
				m := peak.Load()
				if n <= m || peak.CompareAndSwap(m, n) {
					break
				}
			}
			time.Sleep(2 * time.Millisecond)
			active.Add(-1)
			p.Release()
		}()
	}
	wg.Wait()
	if got := peak.Load(); got != 3 {
		t.Fatalf("peak concurrency %d, want exactly the pool's 3", got)
	}
	if s := p.Stats(); s.Active != 0 || s.Queued != 0 {
		t.Fatalf("after all released: %+v", s)
	}
}

func TestPoolIsFIFO(t *testing.T) {
	p := NewPool(1, 10)
	if err := p.Acquire(context.Background()); err != nil {
		t.Fatal(err)
	}
	order := make(chan int, 5)
	for i := range 5 {
		go func() {
			_ = p.Acquire(context.Background())
			order <- i
			p.Release()
		}()
		waitFor(t, func() bool { return p.Stats().Queued == i+1 }) // queue them in order
	}
	p.Release()
	for want := range 5 {
		if got := <-order; got != want {
			t.Fatalf("served %d, want %d (first come, first served)", got, want)
		}
	}
}

func TestPoolQueueFull(t *testing.T) {
	p := NewPool(1, 1)
	_ = p.Acquire(context.Background())
	go func() { _ = p.Acquire(context.Background()) }()
	waitFor(t, func() bool { return p.Stats().Queued == 1 })
	if err := p.Acquire(context.Background()); !errors.Is(err, ErrQueueFull) {
		t.Fatalf("third request: %v, want ErrQueueFull", err)
	}
}

func TestPoolCancelLeavesQueue(t *testing.T) {
	p := NewPool(1, 10)
	_ = p.Acquire(context.Background())
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Millisecond)
	defer cancel()
	if err := p.Acquire(ctx); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("got %v, want the context's deadline", err)
	}
	if s := p.Stats(); s.Queued != 0 || s.Active != 1 {
		t.Fatalf("a cancelled waiter must leave the queue: %+v", s)
	}
	p.Release()
	if err := p.Acquire(context.Background()); err != nil {
		t.Fatal(err)
	}
}

func TestPoolResizeAdmitsWaiters(t *testing.T) {
	p := NewPool(1, 10)
	_ = p.Acquire(context.Background())
	admitted := make(chan struct{}, 3)
	for range 3 {
		go func() {
			_ = p.Acquire(context.Background())
			admitted <- struct{}{}
		}()
	}
	waitFor(t, func() bool { return p.Stats().Queued == 3 })
	p.Resize(4, 10)
	for range 3 {
		select {
		case <-admitted:
		case <-time.After(2 * time.Second):
			t.Fatal("growing the pool must admit the queued requests")
		}
	}
	if s := p.Stats(); s.Active != 4 || s.Workers != 4 {
		t.Fatalf("%+v", s)
	}
	p.Resize(1, 10) // shrinking lets running requests finish; new ones wait
	for range 4 {
		p.Release()
	}
	if s := p.Stats(); s.Active != 0 {
		t.Fatalf("%+v", s)
	}
}

func waitFor(t *testing.T, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatal("condition not reached in 5s")
		}
		time.Sleep(time.Millisecond)
	}
}

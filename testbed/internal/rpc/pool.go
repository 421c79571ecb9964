package rpc

import (
	"container/list"
	"context"
	"errors"
	"sync"
)

// ErrQueueFull is returned by Pool.Acquire when the queue in front of the workers is full.
var ErrQueueFull = errors.New("worker queue full")

// Pool bounds how many requests a service handles at once, with a FIFO queue in front of the
// workers, as a thread-pool server does: a request waits for a free worker, and a pool of 1
// serialises the service. Its size changes at run time (Resize) without dropping requests:
// growing admits queued requests at once, shrinking lets running ones finish.
type Pool struct {
	mu         sync.Mutex
	limit      int
	queueLimit int
	active     int
	waiters    list.List // of chan struct{}, closed when the waiter is granted a worker
}

// NewPool returns a pool of limit workers with room for queueLimit waiting requests.
func NewPool(limit, queueLimit int) *Pool {
	p := &Pool{}
	p.Resize(limit, queueLimit)
	return p
}

// Acquire waits for a worker. It fails with ErrQueueFull when queueLimit requests are already
// waiting, or with the context's error when ctx ends first (the place in the queue is given up).
func (p *Pool) Acquire(ctx context.Context) error {
	p.mu.Lock()
	if p.active < p.limit && p.waiters.Len() == 0 {
		p.active++
		p.mu.Unlock()
		return nil
	}
	if p.waiters.Len() >= p.queueLimit {
		p.mu.Unlock()
		return ErrQueueFull
	}
	granted := make(chan struct{})
	el := p.waiters.PushBack(granted)
	p.mu.Unlock()

	select {
	case <-granted:
		return nil
	case <-ctx.Done():
		p.mu.Lock()
		defer p.mu.Unlock()
		select {
		case <-granted: // granted while ctx ended: hand the worker on
			p.active--
			p.grant()
		default:
			p.waiters.Remove(el)
		}
		return ctx.Err()
	}
}

// Release returns a worker taken by Acquire.
func (p *Pool) Release() {
	p.mu.Lock()
	p.active--
	p.grant()
	p.mu.Unlock()
}

// Resize sets the number of workers and the queue's capacity (both >= 1).
func (p *Pool) Resize(limit, queueLimit int) {
	p.mu.Lock()
	p.limit, p.queueLimit = max(limit, 1), max(queueLimit, 1)
	p.grant()
	p.mu.Unlock()
}

// PoolStats is a snapshot of a pool.
type PoolStats struct {
	Workers int `json:"workers"`
	Active  int `json:"active"`
	Queued  int `json:"queued"`
}

// Stats returns the pool's size, busy workers and waiting requests.
func (p *Pool) Stats() PoolStats {
	p.mu.Lock()
	defer p.mu.Unlock()
	return PoolStats{Workers: p.limit, Active: p.active, Queued: p.waiters.Len()}
}

// grant hands free workers to the longest-waiting requests; p.mu is held.
func (p *Pool) grant() {
	for p.active < p.limit && p.waiters.Len() > 0 {
		ch := p.waiters.Remove(p.waiters.Front()).(chan struct{})
		p.active++
		close(ch)
	}
}
